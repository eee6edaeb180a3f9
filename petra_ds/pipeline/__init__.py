"""The model as a DeepSpeed PipelineModule cut into J PETRA stages: the module, the weights tied across stages,
the cost-balanced partition."""

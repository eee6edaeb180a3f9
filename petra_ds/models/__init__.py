"""Models as DeepSpeed layer specs: RevNets and ResNet baselines (``revnet``)."""

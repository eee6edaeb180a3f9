"""``"bf16"`` and ``"fp16"`` with PETRA (``runtime/precision.py``): a model handed over in bf16 (or fp16) trains as
the same weights in fp32 would, with a warning (before, the toy model stopped on a dtype mismatch in the
reversibility check and RevGPT on its layer norms' mixed dtypes); a GPU without bf16 arithmetic is named."""

import itertools

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from torch import nn

import petra_ds
from petra_ds.models.transformer import lm_loss, revgpt_layers
from petra_ds.runtime.precision import bf16_device_notice
from petra_ds.tools.toy import revgpt_tiny_config, token_data, toy_data, toy_layer_specs


def toy_model(dtype: torch.dtype, name: str = "toy") -> nn.Module:
    """The toy model (batch norms in its couplings: buffers too) or a tiny RevGPT (layer norms, token ids in), its
    weights rounded to bf16, kept in ``dtype``."""
    torch.manual_seed(0)
    layers, loss_fn = (toy_layer_specs(batchnorm=True), nn.CrossEntropyLoss()) if name == "toy" else \
        (revgpt_layers(revgpt_tiny_config(0.0)), lm_loss)
    model = petra_ds.PetraPipelineModule(layers, topology=PipeDataParallelTopology(num_pp=1, num_dp=1),
                                         loss_fn=loss_fn, stages_per_rank=3, partition_method="uniform", base_seed=0)
    return model.to(torch.bfloat16).to(dtype)


@pytest.mark.parametrize("name,section", [("toy", "bf16"), ("revgpt", "bf16"), ("toy", "fp16")])
def test_a_narrow_model_gets_fp32_parameters_and_trains_as_they_would(world_of_one, deepspeed_warnings, name, section):
    """The reference is the same bf16-rounded weights built in fp32: the run handed the bf16 model (fp16 under
    "fp16") matches it bit for bit (losses and weights), its parameters and buffers fp32 from initialize on, and one
    warning counts them."""
    narrow_dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[section])
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
              section: {"enabled": True}, "petra": {"stages_per_rank": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    stream = toy_data(64, 8, dtype=torch.float32) if name == "toy" else token_data(16, 8, 0, torch.float32)
    runs = {}
    for dtype in (torch.float32, narrow_dtype):
        model = toy_model(dtype, name)
        narrow = sum(t.dtype == narrow_dtype for t in itertools.chain(model.parameters(), model.buffers()))
        seen = len(deepspeed_warnings)
        engine, *_ = petra_ds.initialize(model=model, config=config)
        warned = [m for m in deepspeed_warnings[seen:] if "are fp32 now" in m]
        assert len(warned) == (dtype == narrow_dtype) and all(m.startswith(f'"{section}": {narrow} ') for m in warned)
        tensors = list(itertools.chain(engine.module.parameters(), engine.module.buffers()))
        assert all(t.dtype == torch.float32 for t in tensors if t.is_floating_point())
        data = itertools.cycle(stream)
        losses = [engine.train_batch(data) for _ in range(6)]
        runs[dtype] = losses, [t.detach().clone() for t in tensors]
    assert narrow > 0
    (losses, weights), (got_losses, got_weights) = runs[torch.float32], runs[narrow_dtype]
    torch.testing.assert_close(torch.stack(got_losses), torch.stack(losses), rtol=0, atol=0, equal_nan=True)
    assert all(map(torch.equal, weights, got_weights))


def test_an_engine_that_fails_to_build_leaves_a_bf16_model_in_bf16(world_of_one, deepspeed_warnings):
    """PETRA's engine refusing a setting while it is built ("cuda_graphs": true on a CPU): the model's tensors go back
    to bf16 with their values, and no warning says they are fp32."""
    model = toy_model(torch.bfloat16)
    before = [t.detach().clone() for t in itertools.chain(model.parameters(), model.buffers())]
    with pytest.raises(ValueError, match="cuda_graphs"):
        petra_ds.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "petra": {"stages_per_rank": 3, "cuda_graphs": True}})
    after = list(itertools.chain(model.parameters(), model.buffers()))
    assert [t.dtype for t in after] == [t.dtype for t in before] and all(map(torch.equal, after, before))
    assert any(t.dtype == torch.bfloat16 for t in before)
    assert not [m for m in deepspeed_warnings if "are fp32 now" in m]


@pytest.mark.parametrize("capability,name,warns", [((7, 0), "Tesla V100-SXM2-32GB", True), ((7, 5), "Tesla T4", True),
                                                   ((8, 0), "NVIDIA A100", False), ((9, 0), "NVIDIA H200", False)])
def test_bf16_on_a_gpu_without_bf16_arithmetic_is_announced_with_fp16_and_fp32_as_ways_out(capability, name, warns):
    notice = bf16_device_notice(capability, name)
    assert (notice is not None) == warns
    if warns:
        assert name in notice and f"{capability[0]}.{capability[1]}" in notice
        assert "fp32" in notice and '"fp16"' in notice

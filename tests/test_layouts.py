"""A model converted to channels-last before ``petra_ds.initialize`` (``runtime/layouts.py``): DeepSpeed's engine is
built on contiguous copies of the parameters it cannot view as bytes, PETRA's then gets their layout back, DeepSpeed's
own keeps them contiguous and says so. Against the same training from a contiguous model."""

import itertools

import pytest
import torch
from harness import launch, model_for
from torch import nn

import petra_ds
from petra_ds.models.revnet import revnet_layers
from petra_ds.runtime.layouts import make_contiguous, permuted, restore
from test_grad_buffer import FUSED_SGD


def test_the_parameters_deepspeed_cannot_view_as_bytes_get_their_layout_back():
    """Picked: dense weights whose last dimension is not contiguous (channels-last 3x3 and 1x1 convolutions). Left:
    a contiguous weight, a weight that is no dense tensor, and a dense view of a larger storage (a copy would cut
    it loose). Made contiguous, then put back: the same objects, values and strides."""
    g = torch.Generator().manual_seed(0)
    module = nn.Module()
    module.conv = nn.Parameter(torch.randn(8, 4, 3, 3, generator=g).to(memory_format=torch.channels_last))
    module.pointwise = nn.Parameter(torch.randn(8, 4, 1, 1, generator=g).to(memory_format=torch.channels_last))
    module.plain = nn.Parameter(torch.randn(8, 4, generator=g))
    module.strided = nn.Parameter(torch.randn(8, 8, generator=g)[:, ::2])
    module.part = nn.Parameter(torch.randn(4, 8, 3, 3, generator=g).to(memory_format=torch.channels_last)[:2])
    laid_out = permuted(module)
    assert module.pointwise.stride(-1) != 1 and module.part.stride(-1) != 1  # as Module.to lays them out
    assert [id(entry.param) for entry in laid_out] == [id(module.conv), id(module.pointwise)]
    before = {name: (p, p.detach().clone(), p.stride()) for name, p in module.named_parameters()}
    make_contiguous(laid_out)
    assert all(entry.param.stride(-1) == 1 and entry.param.is_contiguous() for entry in laid_out)
    restore(laid_out)
    for name, p in module.named_parameters():
        obj, values, strides = before[name]
        assert p is obj and torch.equal(p, values) and p.stride() == strides, name


def moved_off_rank_0(model: nn.Module) -> None:
    """(before_initialize, in the rank) rank 1's weights moved off rank 0's: DeepSpeed's broadcast while building the
    engine must put rank 0's back."""
    if torch.distributed.get_rank() == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)


def channels_last_model(model: nn.Module) -> None:
    """(before_initialize) :func:`moved_off_rank_0`, then the model to channels-last."""
    moved_off_rank_0(model)
    model.to(memory_format=torch.channels_last)


def test_data_parallel_replicas_built_from_a_channels_last_model_train_as_contiguous_ones():
    """RevNet18's 10 stages on one pipeline rank, 2 data-parallel replicas, float64, fused SGD: rank 1's weights start
    away from rank 0's, so the two replicas agree only through the broadcast of the engine's building, made on the
    contiguous copies. Both replicas end as the contiguous run's to 1e-9."""
    spec = {"model": "revnet", "pipe": 1, "dp": 2, "stages_per_rank": 10, "k": 2, "train_batches": 6,
            "micro_batch": 2, "dropout": 0.0, "optimizer": FUSED_SGD}
    contiguous = launch({**spec, "before_initialize": "test_layouts:moved_off_rank_0"})
    converted = launch({**spec, "before_initialize": "test_layouts:channels_last_model"})
    want = contiguous[0]["params"]
    assert torch.equal(torch.cat([v.flatten() for v in want.values()]),
                       torch.cat([v.flatten() for v in contiguous[1]["params"].values()]))
    for result in converted:
        assert result["params"].keys() == want.keys()
        for name, value in result["params"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-7, atol=1e-9, msg=name)


def test_deepspeeds_own_engine_is_built_from_a_channels_last_model_and_trains_it_contiguous(world_of_one,
                                                                                          deepspeed_warnings):
    """A config without "petra": DeepSpeed's engine trains the converted model as it trains the contiguous one, bit for
    bit, and a warning says its parameters are contiguous now."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 3, 8, 8, generator=g), torch.randint(10, (2,), generator=g)) for _ in range(4)]
    trained, warned = {}, {}
    for layout in ("contiguous", "channels_last"):
        torch.manual_seed(0)
        model = deepspeed_pipeline()
        if layout == "channels_last":
            model.to(memory_format=torch.channels_last)
        seen = len(deepspeed_warnings)
        engine, *_ = petra_ds.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
            "optimizer": FUSED_SGD})
        warned[layout] = [m for m in deepspeed_warnings[seen:] if "were not contiguous" in m]
        assert all(p.stride(-1) == 1 for p in engine.module.parameters() if p.dim())
        batches = itertools.cycle(data)
        for _ in range(3):
            engine.train_batch(batches)
        trained[layout] = [p.detach().clone() for p in engine.module.parameters()]
    assert not warned["contiguous"] and len(warned["channels_last"]) == 1
    assert all(map(torch.equal, trained["contiguous"], trained["channels_last"]))


def deepspeed_pipeline() -> nn.Module:
    """A small RevNet18 as DeepSpeed's own pipeline module, one stage (float32: DeepSpeed reduces no float64
    gradients)."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    return PipelineModule(revnet_layers(18, num_classes=10, cifar=True, base_width=4), loss_fn=nn.CrossEntropyLoss(),
                          topology=PipeDataParallelTopology(num_pp=1, num_dp=1), partition_method="uniform")


def test_an_engine_that_fails_to_build_leaves_the_model_in_its_layout(world_of_one):
    """PETRA's engine refusing a setting while it is built ("cuda_graphs": true on a CPU) hands the model back in the
    layout it came in, its values unchanged."""
    layers, loss_fn, _ = model_for({"model": "revnet"})
    model = petra_ds.PetraPipelineModule(layers, loss_fn=loss_fn, num_stages=1, stages_per_rank=10,
                                         partition_method="uniform")
    model.to(memory_format=torch.channels_last)
    before = [(p.detach().clone(), p.stride()) for p in model.parameters()]
    with pytest.raises(ValueError, match="cuda_graphs"):
        petra_ds.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": FUSED_SGD,
            "petra": {"stages_per_rank": 10, "cuda_graphs": True}})
    assert any(stride[-1] != 1 for _, stride in before)
    for p, (values, stride) in zip(model.parameters(), before):
        assert p.stride() == stride and torch.equal(p, values)

"""A stage's gradients are views of flat buffers (``petra_ds.runtime.grad_buffer``): checked for NaN / Inf after
each backward and cleared after each step as one tensor, not one per parameter, with training unchanged."""

import itertools

import torch
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from harness import launch, merged_params
from torch import nn

import petra_ds
from petra_ds.runtime.grad_buffer import GradBuffer, StageGrads
from petra_ds.tools.toy import toy_data, toy_layer_specs

J, K = 3, 2
#: torch's fused SGD, which pairs a weight's elements with its gradient's in memory order (as its fused AdamW does)
FUSED_SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "fused": True}}


def engine():
    torch.manual_seed(0)
    model = petra_ds.PetraPipelineModule(
        toy_layer_specs(dropout=0.1), topology=PipeDataParallelTopology(num_pp=1, num_dp=1),
        loss_fn=nn.CrossEntropyLoss(), stages_per_rank=J, partition_method="uniform", base_seed=0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": K, "steps_per_print": 10**9,
              "gradient_clipping": 0.5, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
              "petra": {"stages_per_rank": J}}
    e, *_ = petra_ds.initialize(model=model, config=config)
    return e


def params(e):
    return [p.detach().clone() for p in e.module.parameters()]


def test_the_gradients_a_backward_accumulated_are_checked_as_one_tensor_per_stage(world_of_one):
    e = engine()
    data = itertools.cycle(toy_data(4 * K, 4, dtype=torch.float32))
    for _ in range(3):
        e.train_batch(data)
    for j, st in e.stages.items():
        flat = st.grads.buffer.flats
        assert len(flat) == 1 and flat[0].numel() == sum(p.numel() for p in st.stepped)
        for p in st.stepped:
            assert p.grad.untyped_storage().data_ptr() == flat[0].untyped_storage().data_ptr()
        checked = st.grads.tensors()
        assert len(checked) == 1 and checked[0] is flat[0], f"stage {j} reduces its gradients one by one"


def test_gradients_replaced_between_windows_are_taken_back_with_their_values(world_of_one):
    """A ``.grad`` replaced by a copy (what a checkpoint load or a user's code may do) holds micro-batches in
    flight: the next step must apply it, and the buffer takes it back."""
    data = toy_data(4 * K * 4, 4, dtype=torch.float32)
    plain, replaced = engine(), engine()
    for e in (plain, replaced):
        it = iter(data)
        for call in range(4):
            if e is replaced and call == 2:
                for p in e.module.parameters():
                    if p.grad is not None:
                        p.grad = p.grad.clone()
                assert not all(st.grads.buffer.attached() for st in e.stages.values())
            e.train_batch(it)
    assert all(st.grads.buffer.attached() for st in replaced.stages.values())
    for a, b in zip(params(plain), params(replaced)):  # the clipping norm of one window taken per tensor: rounding
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_buffer_keeps_each_gradient_and_groups_by_dtype():
    a = nn.Parameter(torch.ones(2, 3))
    b = nn.Parameter(torch.ones(4, dtype=torch.float64))
    c = nn.Parameter(torch.ones(5))
    c.grad = torch.full((5,), 7.0)
    buffer = GradBuffer([a, b, c])
    assert [f.dtype for f in buffer.flats] == [torch.float32, torch.float64]
    assert buffer.flats[0].tolist() == [0.0] * 6 + [7.0] * 5
    a.grad.add_(1.0)
    assert buffer.flats[0][:6].tolist() == [1.0] * 6
    c.grad = None
    assert [t.data_ptr() for t in buffer.tensors()] == [a.grad.data_ptr(), b.grad.data_ptr()]
    buffer.zero_()
    assert buffer.attached() and all(f.abs().sum() == 0 for f in buffer.flats)


def test_a_frozen_parameter_leaves_the_buffer_at_the_next_step(world_of_one):
    """Frozen after steps that gave it a momentum: no later step moves it (a zero gradient left in the buffer
    would, through the momentum), and the buffer is rebuilt without it."""
    e = engine()
    data = itertools.cycle(toy_data(4 * K, 4, dtype=torch.float32))
    for _ in range(4):
        e.train_batch(data)
    st = e.stages[1]
    assert e.stage_steps[1] >= 2
    frozen = st.stepped[0]
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    for _ in range(3):
        e.train_batch(data)
    assert all(p is not frozen for p in st.grads.buffer.params)
    assert torch.equal(frozen, before)
    assert st.grads.buffer.attached()



def test_a_parameter_unfrozen_again_rejoins_the_buffer_with_its_applied_gradient_cleared():
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    grads = StageGrads([a, b], [a, b])
    b.requires_grad_(False)
    grads.for_step()
    grads.clear()
    assert [p is b for p in grads.buffer.params] == [False] and b.grad is None
    b.requires_grad_(True)
    b.grad = torch.full((2,), 5.0)  # what the next backwards accumulate outside the buffer; the step applies it
    grads.for_step()
    grads.clear()
    assert grads.buffer.attached() and b.grad.tolist() == [0.0, 0.0] and a.grad.tolist() == [0.0] * 3


def test_a_channels_last_weight_has_its_gradient_laid_out_as_autograd_would():
    """torch's fused AdamW pairs a parameter's elements with its gradient's in memory order: a gradient laid out
    otherwise than its weight (a contiguous view of the flat buffer for a channels-last convolution) is applied
    permuted, without an error. The buffer's views take each weight's strides, and the step equals the step with
    autograd's own gradient."""
    torch.manual_seed(0)
    weight, grad = torch.randn(4, 3, 2, 2, dtype=torch.float64), torch.randn(4, 3, 2, 2, dtype=torch.float64)

    def channels_last_weight() -> nn.Parameter:
        return nn.Parameter(weight.clone().contiguous(memory_format=torch.channels_last))

    def stepped(buffered: bool) -> torch.Tensor:
        p = channels_last_weight()
        if buffered:
            GradBuffer([p])
            p.grad.copy_(grad)
        else:
            p.grad = grad.clone().contiguous(memory_format=torch.channels_last)
        torch.optim.AdamW([p], lr=0.1, fused=True).step()
        return p.detach()

    p = channels_last_weight()
    assert GradBuffer([p]).views[0].stride() == p.stride()
    assert torch.equal(stepped(True), stepped(False))


def revnet_engine(layout: str):
    """A small RevNet18 in float64 (J = 10, one process, torch's fused SGD); ``layout``: "contiguous",
    "channels_last" once the engine is built (``engine.module.to``), or "channels_last_before" its ``initialize``
    (which builds DeepSpeed's engine on contiguous copies and puts the layout back: ``runtime/layouts.py``)."""
    from petra_ds.models.revnet import revnet_layers

    torch.manual_seed(0)
    model = petra_ds.PetraPipelineModule(
        revnet_layers(18, num_classes=10, cifar=True, base_width=4), loss_fn=nn.CrossEntropyLoss(),
        topology=PipeDataParallelTopology(num_pp=1, num_dp=1), stages_per_rank=10, partition_method="uniform",
        base_seed=0)
    model.double()
    if layout == "channels_last_before":
        model.to(memory_format=torch.channels_last)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
              "gradient_clipping": 1.0, "petra": {"stages_per_rank": 10},
              "optimizer": FUSED_SGD}
    e, *_ = petra_ds.initialize(model=model, config=config)
    if layout == "channels_last":
        e.module.to(memory_format=torch.channels_last)
    return e


def test_a_channels_last_revnet_trains_as_a_contiguous_one(world_of_one):
    """Float64, torch's fused SGD (as its fused AdamW, it pairs elements in memory order): the weights after eleven
    steps equal the contiguous run's to 1e-9, the convolutions rounding otherwise (paired wrongly: 0.36 apart). The
    module went channels-last after the engine was built, each parameter and its gradient given new storage in place
    (the buffer notices at the step and lays itself out anew), or before it was built, and kept that layout."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(10, (2,), generator=g))
            for _ in range(4)]
    trained = {}
    for layout in ("contiguous", "channels_last", "channels_last_before"):
        e = revnet_engine(layout)
        convolutions = [m.weight for m in e.module.modules() if isinstance(m, nn.Conv2d)]
        laid_out = [w.is_contiguous(memory_format=torch.channels_last) and w.stride(-1) != 1 for w in convolutions]
        assert convolutions and all(laid_out) == (layout != "contiguous") and any(laid_out) == all(laid_out)
        batches = itertools.cycle([(x if layout == "contiguous" else x.contiguous(memory_format=torch.channels_last),
                                    y) for x, y in data])
        for _ in range(12):
            e.train_batch(batches)
        trained[layout] = params(e)
        if layout != "contiguous":
            assert all(w.grad.stride() == w.stride() for w in convolutions)
    for layout in ("channels_last", "channels_last_before"):
        for a, b in zip(trained["contiguous"], trained[layout]):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def channels_last(engine) -> None:
    """(setup, in the rank) the rank's module to channels-last, once the engine is built."""
    engine.module.to(memory_format=torch.channels_last)


def test_channels_last_stages_on_two_ranks_train_as_contiguous_ones():
    """RevNet18's 10 stages over two ranks, float64, fused SGD: messages cross between the ranks as contiguous tensors
    and feed channels-last weights on the other side; the weights end as the contiguous run's to 1e-9."""
    spec = {"model": "revnet", "pipe": 2, "stages_per_rank": 5, "k": 2, "train_batches": 6, "micro_batch": 2,
            "dropout": 0.0, "optimizer": FUSED_SGD}
    contiguous = merged_params(launch(spec))
    converted = merged_params(launch({**spec, "setup": "test_grad_buffer:channels_last"}))
    assert contiguous.keys() == converted.keys()
    for name in contiguous:
        torch.testing.assert_close(converted[name], contiguous[name], rtol=1e-7, atol=1e-9)

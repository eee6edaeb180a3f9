"""``petra_ds.nn.accumulate.backprop`` against ``torch.autograd.backward``: the same gradients, bit for bit, over
a step's micro-batches, with one multi-tensor add per graph instead of one add per parameter."""

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from petra_ds.diagnostics.host_cost import OpCounter
from petra_ds.nn.accumulate import backprop
from petra_ds.nn.window import modules_fixed


def _block(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 6))


def _inputs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("fixed", [False, True], ids=["parameters looked up per graph", "inside modules_fixed"])
def test_gradients_equal_autograd_accumulation_bit_for_bit_over_micro_batches(fixed):
    ours, theirs = _block(0), _block(0)
    with modules_fixed() if fixed else nullcontext():
        _accumulate_both(ours, theirs)


def _accumulate_both(ours: nn.Module, theirs: nn.Module) -> None:
    for x, dy in _inputs(4):
        leaf_a, leaf_b = x.clone().requires_grad_(), x.clone().requires_grad_()
        (dx_a,) = backprop([ours(leaf_a)], [dy], [leaf_a], ours)
        torch.autograd.backward([theirs(leaf_b)], [dy])
        assert torch.equal(dx_a, leaf_b.grad)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_after_the_first_micro_batch_one_foreach_add_replaces_an_add_per_parameter():
    block = _block(0)
    (x, dy), (x2, dy2) = _inputs(2)
    backprop([block(x.requires_grad_())], [dy], [x], block)
    leaf = x2.requires_grad_()
    out = block(leaf)
    with OpCounter() as counter:
        backprop([out], [dy2], [leaf], block)
    assert counter.by_name["_foreach_add_"] == 1
    assert counter.by_name["add_"] == 0


class _Shift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(3, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b


def test_a_gradient_handed_back_is_not_changed_by_later_accumulation():
    """y = x + b: autograd hands one tensor to both x and b. The leaf gradient the caller was given must not
    move when the next micro-batch adds into b.grad."""
    shift = _Shift()
    (x, dy), (x2, dy2) = _inputs(2)
    (dx,) = backprop([shift(x.requires_grad_())], [dy], [x], shift)
    kept = dx.clone()
    (dx2,) = backprop([shift(x2.requires_grad_())], [dy2], [x2], shift)
    kept2 = dx2.clone()
    backprop([shift(x.detach().requires_grad_())], [dy], [x], shift)
    assert torch.equal(dx, kept) and torch.equal(dx2, kept2)
    assert torch.equal(shift.b.grad, dy + dy2 + dy)


def test_a_graph_that_reaches_another_modules_parameter_still_accumulates_it():
    """F closes over a weight it does not hold: that weight is found by autograd's accumulation, every time."""
    torch.manual_seed(0)
    outside = nn.Linear(6, 6)

    class Closure(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * outside(x)

    block = Closure()
    expected = [torch.zeros_like(p) for p in outside.parameters()]
    for x, dy in _inputs(3):
        leaf = x.clone().requires_grad_()
        backprop([block(leaf)], [dy], [leaf], block)
        reference = torch.autograd.grad(block(x), list(outside.parameters()), dy)
        expected = [e + r for e, r in zip(expected, reference)]
    for p, e in zip(outside.parameters(), expected):
        torch.testing.assert_close(p.grad, e)


def test_a_scalar_loss_needs_no_gradient_and_frozen_parameters_get_none():
    block = _block(0)
    block[0].weight.requires_grad_(False)
    for x, _ in _inputs(2):
        leaf = x.clone().requires_grad_()
        (dx,) = backprop([block(leaf).square().mean()], [None], [leaf], block)
        assert dx is not None and dx.shape == x.shape
    assert block[0].weight.grad is None and block[3].weight.grad is not None


def test_a_parameter_replaced_between_micro_batches_still_gets_its_gradient():
    ours, theirs = _block(0), _block(0)
    inputs = _inputs(4)
    for step, (x, dy) in enumerate(inputs):
        if step == 2:  # a new weight object in both, as a user's surgery would make
            for model in (ours, theirs):
                model[3].weight = nn.Parameter(torch.ones(6, 8))
        leaf_a, leaf_b = x.clone().requires_grad_(), x.clone().requires_grad_()
        backprop([ours(leaf_a)], [dy], [leaf_a], ours)
        torch.autograd.backward([theirs(leaf_b)], [dy])
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("engine", ["engine entry point", "public functions"])
def test_the_engine_call_and_the_public_functions_agree_and_check_a_gradient_s_shape(engine, monkeypatch):
    """``backprop`` calls the engine as ``torch.autograd.grad`` / ``backward`` do, without their argument handling;
    a torch without that entry point takes the public functions: the same bits either way, and a gradient of the
    wrong shape is still refused."""
    from petra_ds.nn import accumulate

    if engine == "public functions":
        monkeypatch.setattr(accumulate, "ENGINE_ENTRY", None)
    else:
        assert accumulate.ENGINE_ENTRY is not None  # this torch has it: the test covers the fast path
    ours, theirs = _block(0), _block(0)
    _accumulate_both(ours, theirs)
    leaf = torch.randn(3, 6).requires_grad_()
    with pytest.raises(RuntimeError, match="shape|size"):
        backprop([ours(leaf)], [torch.ones(2, 6)], [leaf], ours)

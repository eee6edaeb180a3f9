"""Batch-norm policy and the invertibility check."""

import pytest
import torch
from torch import nn

from petra_ds.nn import (
    AdditiveCoupling,
    BatchNormPolicy,
    ReversibilityError,
    ReversibleSequential,
    SwapCoupling,
    check_reversible,
    is_reversible,
)


def bn_block(c=4):
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())


@pytest.mark.parametrize("update", [True, False])
def test_a_scope_sets_every_flag_inside_and_restores_each_as_it_was(update):
    """Norms built with and without running statistics in one module: inside, each updates iff ``update``; after,
    each has its own flag back (the scope sets only those that differ)."""
    from petra_ds.nn.batchnorm import norms_running_stats

    norms = [nn.BatchNorm2d(4), nn.BatchNorm2d(4), nn.BatchNorm2d(4)]
    norms[1].track_running_stats = False
    before = [m.track_running_stats for m in norms]
    with norms_running_stats(norms, update):
        assert [m.track_running_stats for m in norms] == [update] * 3
    assert [m.track_running_stats for m in norms] == before


def test_backward_policy_updates_running_stats_only_in_the_backward_scope():
    torch.manual_seed(0)
    layer = SwapCoupling(bn_block()).train()
    bn = layer.F[1]
    x = (torch.randn(3, 4, 6, 6), torch.randn(3, 4, 6, 6) * 3 + 1)
    policy = BatchNormPolicy("backward")
    with policy.forward_scope(layer):
        y = layer(x)
    assert torch.equal(bn.running_mean, torch.zeros(4)) and int(bn.num_batches_tracked) == 0
    assert bn.track_running_stats, "the scope must restore the flag"
    with policy.backward_scope(layer):
        layer.reconstruct(tuple(t.detach() for t in y))
    assert not torch.equal(bn.running_mean, torch.zeros(4)) and int(bn.num_batches_tracked) == 1
    # the forward normalised with batch statistics: same output as plain train mode
    with torch.no_grad():
        plain = SwapCoupling(bn_block()).train()
        plain.load_state_dict(layer.state_dict())
        assert torch.allclose(plain(x)[1], y[1].detach(), atol=1e-6)


def test_forward_policy_updates_in_forward_only():
    torch.manual_seed(0)
    layer = SwapCoupling(bn_block()).train()
    bn = layer.F[1]
    x = (torch.randn(3, 4, 6, 6), torch.randn(3, 4, 6, 6))
    policy = BatchNormPolicy("forward")
    with policy.forward_scope(layer):
        y = layer(x)
    assert int(bn.num_batches_tracked) == 1
    with policy.backward_scope(layer):
        layer.reconstruct(tuple(t.detach() for t in y))
    assert int(bn.num_batches_tracked) == 1


def test_bad_policy_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="bn_running_stats must be one of"):
        BatchNormPolicy("sometimes")


class WrongInverse(AdditiveCoupling):
    def inverse(self, y):
        y1, y2 = y
        x2 = y2 + self.G(y1)  # wrong sign
        return y1 - self.F(x2), x2


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def test_check_reversible_passes_good_layers_and_does_not_touch_bn_stats():
    torch.manual_seed(1)
    chain = ReversibleSequential(SwapCoupling(bn_block()), SwapCoupling(bn_block())).double().train()
    x = tuple(torch.randn(2, 4, 5, 5, dtype=torch.float64) for _ in range(2))
    err = check_reversible(chain, x)
    assert err < 1e-12
    assert all(int(m.num_batches_tracked) == 0 for m in chain.modules() if isinstance(m, nn.BatchNorm2d))


def test_check_reversible_names_the_layer_and_the_error():
    torch.manual_seed(2)
    chain = ReversibleSequential(AdditiveCoupling(mlp(), mlp()), WrongInverse(mlp(), mlp())).double()
    x = tuple(torch.randn(3, 4, dtype=torch.float64) for _ in range(2))
    with pytest.raises(ReversibilityError, match=r"stage3\.layers\.1 \(WrongInverse\) does not invert: .* = \d\.\d+e[-+]\d+"):
        check_reversible(chain, x, name="stage3")


def test_check_reversible_rejects_module_without_inverse():
    assert not is_reversible(nn.Linear(2, 2))
    with pytest.raises(ReversibilityError, match="has no inverse"):
        check_reversible(nn.Linear(2, 2), torch.randn(1, 2), name="head")


def test_a_non_finite_input_is_named_as_such_not_as_a_wrong_inverse():
    """A NaN in the data fails every round trip; the error must say NaN, not send the user to the inverse."""

    layer = AdditiveCoupling(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    x = (torch.randn(3, 4), torch.randn(3, 4))
    x[0][1, 2] = float("nan")
    with pytest.raises(FloatingPointError,
                       match="the input of AdditiveCoupling holds NaN values; check the data"):
        check_reversible(layer, x)
    with torch.no_grad():
        layer.F.weight.fill_(float("inf"))
    with pytest.raises(FloatingPointError, match="the output of AdditiveCoupling on a finite input holds"):
        check_reversible(layer, (torch.randn(3, 4), torch.randn(3, 4)))


class Scaled(nn.Module):
    """A map with outputs of order 1e4 on inputs of order 1: rounding of y = x + F(.) is then 1e-3."""

    def __init__(self):
        super().__init__()
        self.inner = mlp()

    def forward(self, x):
        return 1e4 * self.inner(x)


def test_a_right_inverse_that_rounding_defeats_in_float32_passes_and_a_wrong_one_fails_in_float64():
    """A trained block's large F and G make a right inverse miss float32's tolerance: the float64 copy
    tells it from a wrong inverse, which fails in every precision and is named as such."""
    torch.manual_seed(3)
    x = tuple(torch.randn(16, 4) for _ in range(2))
    right = AdditiveCoupling(Scaled(), Scaled())
    with torch.no_grad():
        y = right(x)
        float32_error = max(float((a - b).abs().max()) for a, b in zip(right.inverse(y), x))
    assert float32_error > 1e-4, "the example must defeat float32's tolerance, or it tests nothing"
    assert check_reversible(right, x) == pytest.approx(float32_error)
    assert right.F.inner[0].weight.dtype == torch.float32  # the float64 round trip ran on a copy
    wrong = ReversibleSequential(AdditiveCoupling(Scaled(), Scaled()), WrongInverse(Scaled(), Scaled()))
    with pytest.raises(ReversibilityError, match=r"stage3\.layers\.1 \(WrongInverse\) does not invert in float64"):
        check_reversible(wrong, x, name="stage3")


class Float32Only(AdditiveCoupling):
    """Stands for a fused kernel without float64: the float32 verdict must stand."""

    def forward(self, x):
        if x[0].dtype == torch.float64:
            raise RuntimeError("no float64 kernel")
        return super().forward(x)


def test_a_layer_that_cannot_run_in_float64_keeps_the_float32_verdict():
    torch.manual_seed(4)
    x = tuple(torch.randn(16, 4) for _ in range(2))
    with pytest.raises(ReversibilityError, match=r"Float32Only does not invert: max \|"):
        check_reversible(Float32Only(Scaled(), Scaled()), x)

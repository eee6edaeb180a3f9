"""Couplings invert, and the reconstruct-with-graph path gives autograd's gradients (float64)."""

import pytest
import torch
from torch import nn

from petra_ds.nn import AdditiveCoupling, Merge, ReversibleSequential, Split, SwapCoupling, reconstruction_error

SEEDS = [0, 1, 2]


def mlp(d=6, h=10):
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, d))


def conv(c=3):
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))


def make(kind, body, seed):
    torch.manual_seed(seed)
    f = mlp if body == "mlp" else conv
    layer = AdditiveCoupling(f(), f()) if kind == "additive" else SwapCoupling(f())
    x = (torch.randn(4, 6), torch.randn(4, 6)) if body == "mlp" else (torch.randn(2, 3, 5, 5), torch.randn(2, 3, 5, 5))
    return layer.double(), tuple(t.double() for t in x)


CASES = [(kind, body) for kind in ("additive", "swap") for body in ("mlp", "conv")]


@pytest.mark.parametrize("kind,body", CASES)
@pytest.mark.parametrize("seed", SEEDS)
def test_inverse_is_exact_in_float64(kind, body, seed):
    layer, x = make(kind, body, seed)
    with torch.no_grad():
        y = layer(x)
        assert reconstruction_error(x, y) > 1e-3, "the coupling must actually transform its input"
        assert reconstruction_error(x, layer.inverse(y)) < 1e-12
        x_rec, _tape = layer.reconstruct(y)
    assert reconstruction_error(x, x_rec) < 1e-12


def autograd_reference(layer, x, w):
    x = tuple(t.clone().requires_grad_() for t in x)
    layer.zero_grad()
    y = layer(x)
    sum((a * b).sum() for a, b in zip(y, w)).backward()
    return y, [t.grad.clone() for t in x], {n: p.grad.clone() for n, p in layer.named_parameters()}


def reconstruct_path(layer, y, w):
    layer.zero_grad()
    x_rec, tape = layer.reconstruct(tuple(t.detach() for t in y))
    dx = tape.backward(w)
    return x_rec, list(dx), {n: p.grad.clone() for n, p in layer.named_parameters()}


def assert_close(a, b, tol):
    assert (a - b).abs().max().item() < tol, (a - b).abs().max().item()


@pytest.mark.parametrize("kind,body", CASES)
@pytest.mark.parametrize("seed", SEEDS)
def test_reconstruct_gradients_equal_autograd(kind, body, seed):
    layer, x = make(kind, body, seed)
    w = tuple(torch.randn_like(t) for t in x)
    y, dx_ref, grads_ref = autograd_reference(layer, x, w)
    x_rec, dx, grads = reconstruct_path(layer, y, w)
    for a, b in zip(dx, dx_ref):
        assert_close(a, b, 1e-10)
    assert grads.keys() == grads_ref.keys() and grads
    for name in grads:
        assert_close(grads[name], grads_ref[name], 1e-10)


class Counting(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


@pytest.mark.parametrize("kind", ["additive", "swap"])
def test_each_function_runs_once_in_forward_and_once_in_reconstruction(kind):
    torch.manual_seed(0)
    F, G = Counting(mlp()), Counting(mlp())
    layer = (AdditiveCoupling(F, G) if kind == "additive" else SwapCoupling(F)).double()
    x = (torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64))
    y = layer(x)
    assert F.calls == 1
    _x, tape = layer.reconstruct(tuple(t.detach() for t in y))
    tape.backward(tuple(torch.ones_like(t) for t in y))
    assert F.calls == 2, "F must be evaluated once in the forward and once in the reconstruction"
    if kind == "additive":
        assert G.calls == 2
    else:
        assert G.calls == 0


def test_chain_with_split_and_merge_inverts_and_matches_autograd():
    torch.manual_seed(3)
    chain = ReversibleSequential(
        Split(dim=1),
        AdditiveCoupling(mlp(3, 8), mlp(3, 8)),
        SwapCoupling(mlp(3, 8)),
        AdditiveCoupling(mlp(3, 8), mlp(3, 8)),
        Merge(dim=1),
    ).double()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64)
    y = chain(x)
    (y * w).sum().backward()
    dx_ref = x.grad.clone()
    grads_ref = {n: p.grad.clone() for n, p in chain.named_parameters()}
    chain.zero_grad()
    x_rec, tape = chain.reconstruct(y.detach())
    assert reconstruction_error(x.detach(), x_rec) < 1e-12
    dx = tape.backward(w)
    assert_close(dx, dx_ref, 1e-10)
    for n, p in chain.named_parameters():
        assert_close(p.grad, grads_ref[n], 1e-10)


def test_chain_rejects_a_layer_without_inverse():
    with pytest.raises(TypeError, match=r"layer 1 \(Linear\) has no inverse"):
        ReversibleSequential(Split(), nn.Linear(3, 3))

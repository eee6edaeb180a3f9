"""Dropout inside F: keyed streams make the reconstruction exact; the global stream does not."""

import pytest
import torch
from torch import nn

from petra_ds.nn import (AdditiveCoupling, SwapCoupling, ReversibleSequential, derive_seed, layer_rng,
                         micro_batch_rng, reconstruction_error)


def dropout_mlp(d=8, p=0.5):
    return nn.Sequential(nn.Linear(d, 16), nn.Dropout(p), nn.Tanh(), nn.Linear(16, d))


def make_layer():
    torch.manual_seed(0)
    return ReversibleSequential(
        AdditiveCoupling(dropout_mlp(), dropout_mlp()), SwapCoupling(dropout_mlp())
    ).double().train()


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(6, 8, generator=g, dtype=torch.float64) for _ in range(2))


def test_keyed_reconstruction_is_exact_while_other_micro_batches_pass_through():
    layer = make_layer()
    x0, x1 = inputs(0), inputs(1)
    with torch.no_grad():
        with micro_batch_rng(seed=7, micro_batch=0, stage=2):
            y0 = layer(x0)
        with micro_batch_rng(seed=7, micro_batch=1, stage=2):
            layer(x1)  # another micro-batch in between, as in the pipeline
        torch.rand(100)  # and some unrelated use of the global stream
        with micro_batch_rng(seed=7, micro_batch=0, stage=2):
            x0_rec, _ = layer.reconstruct(y0)
    assert reconstruction_error(x0, x0_rec) < 1e-12


def test_global_stream_control_is_inexact():
    layer = make_layer()
    x0 = inputs(0)
    with torch.no_grad():
        y0 = layer(x0)
        x0_rec = layer.inverse(y0)
    assert reconstruction_error(x0, x0_rec) > 1e-2


def test_masks_differ_between_micro_batches_stages_and_layers_but_not_calls():
    layer = make_layer()
    x = inputs(0)
    outs = {}
    with torch.no_grad():
        for key in [(7, 0, 2), (7, 1, 2), (7, 0, 3), (8, 0, 2), (7, 0, 2)]:
            with micro_batch_rng(*key):
                outs.setdefault(key, []).append(layer(x)[0])
    base = outs[(7, 0, 2)]
    assert torch.equal(base[0], base[1])
    for key in [(7, 1, 2), (7, 0, 3), (8, 0, 2)]:
        assert not torch.allclose(base[0], outs[key][0])
    a, b = layer.layers[0], layer.layers[1]
    assert a.rng_key != b.rng_key


def test_global_stream_is_restored_after_a_keyed_scope():
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    with micro_batch_rng(1, 2, 3):
        torch.rand(50)
    assert torch.equal(torch.rand(5), expected)


def test_keyed_gradients_match_autograd_with_dropout():
    layer = make_layer()
    x = tuple(t.clone().requires_grad_() for t in inputs(4))
    w = tuple(torch.randn_like(t) for t in x)
    with micro_batch_rng(3, 5, 1):
        y = layer(x)
    sum((a * b).sum() for a, b in zip(y, w)).backward()
    ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    dx_ref = [t.grad.clone() for t in x]
    layer.zero_grad()
    with micro_batch_rng(3, 5, 1):
        _x, tape = layer.reconstruct(tuple(t.detach() for t in y))
    dx = tape.backward(w)
    for a, b in zip(dx, dx_ref):
        assert (a - b).abs().max() < 1e-10
    for n, p in layer.named_parameters():
        assert (p.grad - ref[n]).abs().max() < 1e-10


def test_derived_seeds_depend_on_order_and_every_part():
    assert derive_seed(1, 2, 3) != derive_seed(3, 2, 1)
    assert len({derive_seed(0, m, 0) for m in range(1000)}) == 1000


@pytest.mark.parametrize("seed, m, stage, layer, branch", [(0, 0, 0, 0, 0), (3, 5, 1, 7, 1), (2**40, 9, 17, 1234, 2)])
def test_a_layer_draws_from_its_whole_key_s_derived_seed(seed, m, stage, layer, branch):
    """A layer's stream inside a micro-batch scope is the stream of (seed, micro-batch, stage, replica, layer,
    branch): the per-layer fold continues the scope's key as ``derive_seed`` folds the whole key."""
    with micro_batch_rng(seed, m, stage):
        with layer_rng(layer, branch):
            drawn = torch.rand(8)
    torch.manual_seed(derive_seed(seed, m, stage, 0, layer, branch))
    assert torch.equal(drawn, torch.rand(8))


def test_a_keyed_scope_does_not_ask_whether_cuda_is_available(monkeypatch):
    """DeepSpeed sets PYTORCH_NVML_BASED_CUDA_CHECK=1, so on a machine without a GPU a CUDA build answers
    ``torch.cuda.is_available()`` by loading NVML again on every call; a scope runs twice per layer and
    micro-batch, so it forks the current device's generator only once CUDA is initialised, and the draws are
    the same as ever."""
    layer = make_layer()
    x = inputs(0)
    with torch.no_grad(), micro_batch_rng(seed=7, micro_batch=0, stage=2):
        before = layer(x)

    def refuse():
        raise AssertionError("a keyed scope asked torch.cuda.is_available()")

    monkeypatch.setattr(torch.cuda, "is_available", refuse)
    with torch.no_grad(), micro_batch_rng(seed=7, micro_batch=0, stage=2):
        after = layer(x)
    assert all(torch.equal(a, b) for a, b in zip(before, after))

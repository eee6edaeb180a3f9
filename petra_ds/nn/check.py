"""Invertibility check: a wrong ``inverse`` must not silently train a wrong model."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from .batchnorm import running_stats
from .reversible import Activation, ReversibleSequential, as_tuple, is_reversible, shaped_like
from .rng import micro_batch_rng

_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


class ReversibilityError(ValueError):
    """A layer declared reversible whose inverse does not reproduce its input."""


class NonFiniteError(RuntimeError, FloatingPointError):
    """A NaN or Inf, named as such: a round trip, a loss or a gradient through one fails whatever the code
    is, so it must not send the user to an inverse or an optimizer that is right. Also a
    ``FloatingPointError``, which the non-finite checks raised before it existed.

    ``kind`` ("micro-batch", "activation", "reconstruction", "loss", "gradient"), ``stage``,
    ``micro_batch``, ``clock`` and ``value`` ("NaN" or "Inf") say where training first met it; None
    when the check that raised does not know (a standalone :func:`check_reversible`)."""

    def __init__(self, message: str, *, kind: str | None = None, stage: int | None = None,
                 micro_batch: int | None = None, clock: int | None = None, value: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.stage, self.micro_batch, self.clock, self.value = kind, stage, micro_batch, clock, value


def default_tolerance(example: Activation) -> float:
    """Tolerance on the max error, relative to max(1, max |x|), for the example's dtype."""
    dtype = as_tuple(example)[0].dtype
    return _TOLERANCE.get(dtype, 1e-4)


def reconstruction_error(x: Activation, x_rec: Activation) -> float:
    """max |x_rec - x| over every tensor of the activation."""
    return max(float((b.to(a.dtype) - a).abs().max()) for a, b in zip(as_tuple(x), as_tuple(x_rec)))


def _scale(x: Activation) -> float:
    return max(1.0, max(float(t.abs().max()) for t in as_tuple(x) if t.numel()))


def _refuse_non_finite(x: Activation, what: str, fix: str) -> None:
    """A NaN or Inf is named as such: a round trip through it fails for any inverse, right or wrong."""
    bad = [t for t in as_tuple(x) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        kinds = " and ".join(k for k, f in (("NaN", torch.isnan), ("Inf", torch.isinf)) if any(f(t).any() for t in bad))
        raise NonFiniteError(f"{what} holds {kinds} values; {fix}", value=kinds)


def _round_trip(module: nn.Module, x: Activation, seed: int) -> tuple[Activation, float]:
    with torch.no_grad(), running_stats(module, update=False), micro_batch_rng(seed, 0, 0):
        y = module(x)
        x_rec = module.inverse(y)
    return y, reconstruction_error(x, x_rec)


def _in_float64(module: nn.Module, example: Activation, seed: int) -> tuple[nn.Module, Activation, float] | None:
    """The round trip of a float64 copy of the module (the copy, its input, its error); None where the module
    cannot run in float64 (a kernel without it, or no memory for the copy): the low precision's verdict stands."""
    x = shaped_like(example, [t.to(torch.float64) if t.is_floating_point() else t for t in as_tuple(example)])
    try:
        module64 = copy.deepcopy(module).to(torch.float64)
        return module64, x, _round_trip(module64, x, seed)[1]
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _first_failure(module: nn.Module, example: Activation, tol: float, seed: int) -> tuple[str | None, float]:
    """The first layer of a ReversibleSequential whose round trip fails, and its error."""
    x = example
    for i, layer in enumerate(module.layers):
        y, error = _round_trip(layer, x, seed)
        if not error <= tol * _scale(x):  # NaN counts as a failure
            return f".layers.{i} ({type(layer).__name__})", error
        x = y
    return None, math.nan


def check_reversible(
    module: nn.Module,
    example: Activation,
    *,
    tol: float | None = None,
    name: str | None = None,
    seed: int = 0,
) -> float:
    """Max ``|inverse(forward(x)) - x|`` on ``example``; raises :class:`ReversibilityError` above ``tol``.

    Runs in the module's current mode under a fixed keyed RNG (dropout draws the same mask in both
    directions) and never touches batch-norm running statistics. For a :class:`ReversibleSequential`
    the error names the first layer that fails.

    A round trip above ``tol`` in a low precision is run again on a float64 copy of the module: a trained
    block's large F and G amplify rounding (a right inverse, which training's reconstruction meets
    anyway), whereas a wrong inverse is wrong in every precision. Only the second failure raises.
    """
    name = name or type(module).__name__
    if not is_reversible(module):
        raise ReversibilityError(
            f"{name} ({type(module).__name__}) is declared reversible but has no inverse(); "
            "implement inverse() or mark the layer non-reversible"
        )
    tol = default_tolerance(example) if tol is None else tol
    _refuse_non_finite(example, f"the input of {name}", "check the data (or the layer before it)")
    bound = tol * _scale(example)
    y, error = _round_trip(module, example, seed)
    _refuse_non_finite(y, f"the output of {name} on a finite input",
                       "check its weights and the learning rate; its inverse was not tested")
    if error <= bound:
        return error
    precision = ""
    if as_tuple(example)[0].dtype != torch.float64 and (exact := _in_float64(module, example, seed)) is not None:
        module, example, error64 = exact
        tol = default_tolerance(example)
        bound = tol * _scale(example)
        if error64 <= bound:
            return error
        error, precision = error64, " in float64"
    culprit, culprit_error = name, error
    if isinstance(module, ReversibleSequential):
        layer, layer_error = _first_failure(module, example, tol, seed)
        if layer is not None:
            culprit, culprit_error = name + layer, layer_error
    if not math.isfinite(culprit_error):  # finite input and output: the inverse itself made the NaN / Inf
        raise ReversibilityError(
            f"{culprit} does not invert: its inverse() returns {'NaN' if math.isnan(culprit_error) else 'Inf'} "
            "on the finite output of a finite input (an overflow or a division by zero inside inverse()); "
            "fix its inverse() or declare it non-reversible")
    raise ReversibilityError(
        f"{culprit} does not invert{precision}: max |inverse(forward(x)) - x| = {culprit_error:.3e} "
        f"exceeds the tolerance {bound:.1e}; fix its inverse() or declare it non-reversible"
    )

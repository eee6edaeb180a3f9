"""bf16 casts of the weights, made once per stage and clock.

Under autocast every evaluation casts each fp32 weight it uses to bf16, and autocast drops those casts when its
outermost region ends. A PETRA stage evaluates its layers twice per micro-batch, both times with the weights the
clock began with: the forward, then the reconstruction or recomputation its backward differentiates. So each weight
was cast twice where backprop casts it once (RevNet18 at J = 10 in bf16: 192 of a call's 2,132 ops, each a kernel
launch on a GPU). :func:`clock_casts` keeps autocast's cache for a whole clock, so the second evaluation reads the
first one's casts, bit for bit the casts it would make. Whatever writes weights in place while a clock runs (an
optimizer step, weight prediction, a weight stash swapped in, tied weights arriving) calls :func:`weights_written`,
which drops them.

The forward runs under ``no_grad`` and the evaluation after it records a graph through the same casts: only a torch
whose autocast cache keeps a cast made under ``no_grad`` differentiable (pytorch/pytorch#165068) may share them.
Older ones would hand the graph a cast without history, and the weights no gradient: there every evaluation casts
anew, as before (:func:`shares_casts`, asked once).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import ContextManager

import torch


@functools.cache
def shares_casts() -> bool:
    """Whether this torch's autocast cache may be shared between a ``no_grad`` evaluation and one with grad: a cast
    cached under ``no_grad`` still carries the weight's gradient (checked on the CPU; the cache is the same code on
    every device). Asked in whatever mode the caller is in: grad is enabled for the question."""
    with torch.inference_mode(False), torch.enable_grad():
        weight = torch.ones(1, 1, requires_grad=True)
        x = torch.ones(1, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                torch.mm(x, weight)
            out = torch.mm(x, weight)
    return out.requires_grad


class _ClockCasts:
    """Inside, the casts autocast makes outlive its regions: one more level of its nesting is held, and the cache is
    dropped on the way out."""

    __slots__ = ()

    def __enter__(self) -> None:
        torch.autocast_increment_nesting()

    def __exit__(self, *exc: object) -> None:
        torch.autocast_decrement_nesting()
        torch.clear_autocast_cache()


def clock_casts() -> ContextManager[None]:
    """What a clock runs under: the casts of its weights shared by its evaluations (when :func:`shares_casts`)."""
    return _ClockCasts() if shares_casts() else nullcontext()


def weights_written() -> None:
    """Drop the casts made so far: some weight was just written in place, and a cast of its old value is stale."""
    torch.clear_autocast_cache()

"""Parameters laid out other than contiguously (channels-last convolutions) through the building of an engine.

DeepSpeed's engine broadcasts every parameter as bytes while it is built (``p.data.view(torch.uint8)``), which a
tensor whose last dimension is not contiguous cannot be viewed as. A model converted to channels-last before
``initialize``, as PyTorch's recipe converts it, fails there ("self.stride(-1) must be 1 to view Float as Byte").
So ``petra_ds.initialize`` builds the engine on contiguous parameters and then gives PETRA's each parameter its
layout back, values unchanged: PETRA keeps any dense layout from then on (its gradient buffer lays each ``.grad`` out
as its parameter is). DeepSpeed's own engine (a config without ``"petra"``) may flatten parameters into buffers of
its own (its bf16 optimizer, ZeRO), so there they stay contiguous, and a warning says so.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

import torch
from deepspeed.utils import logger
from torch import Tensor, nn

from .distributed import is_rank0
from .grad_buffer import gradient_strides


class LaidOut(NamedTuple):
    """A parameter and the strides it had before it was made contiguous."""

    param: Tensor
    strides: tuple[int, ...]


def permuted(module: nn.Module) -> list[LaidOut]:
    """The parameters of ``module`` that DeepSpeed cannot view as bytes (a last dimension not contiguous, as in
    channels-last, a 1x1 convolution's weight too) and that a contiguous copy can stand in for: dense, each the only
    tensor on its storage (no view of another to break). With their strides."""
    found = []
    for p in module.parameters():
        if p.dim() == 0 or p.stride(-1) == 1 or gradient_strides(p) != p.stride():
            continue  # viewable as bytes, or not dense: left as it is
        if p.untyped_storage().nbytes() == p.numel() * p.element_size():
            found.append(LaidOut(p, p.stride()))
    return found


def make_contiguous(laid_out: list[LaidOut]) -> None:
    """Each parameter of ``laid_out`` on contiguous memory, in place (``.data``: the same ``Parameter`` object)."""
    for p, _ in laid_out:
        p.data = p.data.clone(memory_format=torch.contiguous_format)


def restore(laid_out: list[LaidOut]) -> None:
    """Each parameter of ``laid_out`` back in the layout :func:`permuted` found, with the values it holds now."""
    for p, strides in laid_out:
        back = torch.empty_strided(p.shape, strides, dtype=p.dtype, device=p.device)
        back.copy_(p.data)
        p.data = back


@contextmanager
def built_contiguous(model: Any, keep_layout: bool) -> Iterator[None]:
    """Inside, ``model``'s parameters that DeepSpeed cannot view as bytes are contiguous (:func:`permuted`). On the
    way out they get their layout back where ``keep_layout`` (PETRA's engine) or where building the engine failed;
    else (DeepSpeed's own engine) they stay contiguous, which rank 0 warns of."""
    laid_out = permuted(model) if isinstance(model, nn.Module) else []
    make_contiguous(laid_out)
    try:
        yield
    except BaseException:
        restore(laid_out)
        raise
    if keep_layout:
        restore(laid_out)
    elif laid_out and is_rank0():
        logger.warning(kept_contiguous_notice(laid_out))


def kept_contiguous_notice(laid_out: list[LaidOut]) -> str:
    """The warning for DeepSpeed's own engine, built on the contiguous copies of ``laid_out``."""
    return (f"{len(laid_out)} parameters were not contiguous (a model converted to channels-last): DeepSpeed's engine "
            "broadcasts each parameter as bytes while it is built and may flatten them into its own buffers, so they "
            "are contiguous now and train so. PETRA's engine (a \"petra\" section) keeps their layout")

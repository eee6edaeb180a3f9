"""What ``"bf16"`` and ``"fp16"`` mean for PETRA, and what ``initialize`` makes of a model and a GPU for them.

PETRA's mixed precision keeps parameters, gradients, optimizer state and the residual streams in fp32 and runs each
stage's layers under bf16 or fp16 autocast (DeepSpeed's keeps fp32 master weights too, beside narrow copies); fp16
adds a loss scale per stage (``runtime/loss_scale.py``). A model handed over in bf16 or fp16
(``from_pretrained(torch_dtype=torch.bfloat16)``, ``model.to(torch.bfloat16)``) therefore gets fp32 parameters and
buffers, the same values, with a warning: left narrow, its weights would meet fp32 inputs outside autocast (the
reversibility check) and be stepped in the narrow dtype. A GPU without bf16 arithmetic (compute capability below
8.0) is named under bf16, with fp16 and fp32 as the ways out.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

import torch
from deepspeed.utils import logger
from torch import nn

from .distributed import is_rank0
from .loss_scale import LossScaleConfig


class Precision(NamedTuple):
    """A run's arithmetic: the autocast dtype its stages run under (None: fp32) and, for fp16, its loss scaling."""

    autocast: torch.dtype | None = None
    loss_scale: LossScaleConfig | None = None

    @property
    def name(self) -> str:
        """The config section that asked for it ("bf16", "fp16"), or "fp32"."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.autocast, "fp32")

    def describe(self) -> str:
        """How the settings print names it."""
        return self.loss_scale.describe() if self.loss_scale is not None else self.name


#: floating dtypes narrower than fp32, which mixed precision's fp32 parameters are made from
_NARROW = (torch.bfloat16, torch.float16)


@contextmanager
def float32_while_built(module: Any, precision: Precision) -> Iterator[None]:
    """Under bf16 or fp16: inside, ``module``'s bf16 and fp16 parameters and buffers are fp32, in place (``.data``: the
    same objects, their layouts kept), and stay so after, which rank 0 warns of; where building the engine fails they
    go back to their dtypes (exactly: the values came from them)."""
    narrow = [t for t in itertools.chain(module.parameters(), module.buffers())
              if t.dtype in _NARROW] if precision.autocast is not None and isinstance(module, nn.Module) else []
    dtypes = [t.dtype for t in narrow]
    for t in narrow:
        t.data = t.data.float()
    try:
        yield
    except BaseException:
        for t, dtype in zip(narrow, dtypes):
            t.data = t.data.to(dtype)
        raise
    if narrow and is_rank0():
        logger.warning(float32_notice(len(narrow), precision.name))


def float32_notice(converted: int, section: str = "bf16") -> str:
    """The warning for :func:`float32_while_built` having converted ``converted`` tensors under ``section``."""
    return (f'"{section}": {converted} parameters and buffers of the model were bf16 or fp16 and are fp32 now: PETRA '
            f"keeps fp32 parameters, gradients and optimizer state and runs each stage under {section} autocast (as "
            f"DeepSpeed's {section} keeps fp32 master weights). Build the model in fp32 to start from full-precision "
            "weights")


def bf16_device_notice(capability: tuple[int, int], name: str) -> str | None:
    """What ``"bf16"`` does on a CUDA device of compute capability ``capability`` (named ``name``): None from 8.0 on
    (Ampere), which computes in bf16; a warning before, where torch emulates bf16 or has no kernel for it."""
    if capability >= (8, 0):
        return None
    major, minor = capability
    return (f'"bf16" on {name} (compute capability {major}.{minor}): bf16 arithmetic needs compute capability 8.0 '
            "or later (A100, H100, RTX 30xx), and before that torch emulates it, slower than fp32, or finds no kernel. "
            'Train in fp16 here ("fp16": {"enabled": true}, a loss scale per stage) or in fp32 (neither section)')

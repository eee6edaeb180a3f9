"""What ``"bf16": {"enabled": true}`` means for PETRA, and what ``initialize`` makes of a model and a GPU for it.

PETRA's bf16 keeps parameters, gradients, optimizer state and the residual streams in fp32 and runs each stage's
layers under bf16 autocast (DeepSpeed's bf16 keeps fp32 master weights too, beside bf16 copies). A model handed over
in bf16 or fp16 (``from_pretrained(torch_dtype=torch.bfloat16)``, ``model.to(torch.bfloat16)``) therefore gets fp32
parameters and buffers, the same values, with a warning: left narrow, its weights would meet fp32 inputs outside
autocast (the reversibility check) and be stepped in bf16. A GPU without bf16 arithmetic (compute capability below
8.0) is named, with fp32 as the way out.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from deepspeed.utils import logger
from torch import nn

from .distributed import is_rank0

#: floating dtypes narrower than fp32, which bf16's fp32 parameters are made from
_NARROW = (torch.bfloat16, torch.float16)


@contextmanager
def float32_while_built(module: Any, bf16: bool) -> Iterator[None]:
    """Under ``bf16``: inside, ``module``'s bf16 and fp16 parameters and buffers are fp32, in place (``.data``: the same
    objects, their layouts kept), and stay so after, which rank 0 warns of; where building the engine fails they
    go back to their dtypes (exactly: the values came from them)."""
    narrow = [t for t in itertools.chain(module.parameters(), module.buffers())
              if t.dtype in _NARROW] if bf16 and isinstance(module, nn.Module) else []
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
        logger.warning(float32_notice(len(narrow)))


def float32_notice(converted: int) -> str:
    """The warning for :func:`float32_while_built` having converted ``converted`` tensors."""
    return (f'"bf16": {converted} parameters and buffers of the model were bf16 or fp16 and are fp32 now: PETRA keeps '
            "fp32 parameters, gradients and optimizer state and runs each stage under bf16 autocast (as DeepSpeed's "
            "bf16 keeps fp32 master weights). Build the model in fp32 to start from full-precision weights")


def bf16_device_notice(capability: tuple[int, int], name: str) -> str | None:
    """What ``"bf16"`` does on a CUDA device of compute capability ``capability`` (named ``name``): None from 8.0 on
    (Ampere), which computes in bf16; a warning before, where torch emulates bf16 or has no kernel for it."""
    if capability >= (8, 0):
        return None
    major, minor = capability
    return (f'"bf16" on {name} (compute capability {major}.{minor}): bf16 arithmetic needs compute capability 8.0 '
            "or later (A100, H100, RTX 30xx), and before that torch emulates it, slower than fp32, or finds no kernel. "
            'Train in fp32 here: remove "bf16" from the config')

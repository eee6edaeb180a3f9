"""What a stage runs every instruction under: the keyed random streams of its micro-batch, and whether its batch
norms update their running statistics. One class, not a generator function nesting two: a stage enters a scope
at every instruction, and ``contextlib``'s generator machinery was a visible part of a clock's host time."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

from torch import nn

from ..nn.batchnorm import norms_running_stats
from ..nn.rng import RowBlocks, micro_batch_rng


class StageScope:
    """The keyed RNG of (seed, micro-batch ``m``, ``stage``, replica ``rows``) outside, unless nothing the stage runs
    can draw (``keyed`` false, ``nn.draws``: there is nothing to key); inside it, ``norms`` update their running
    statistics iff ``update_bn``."""

    __slots__ = ("_rng", "_norms")

    def __init__(self, seed: int, m: int, stage: int, rows: int | RowBlocks,
                 norms: Sequence[nn.modules.batchnorm._BatchNorm], update_bn: bool, keyed: bool = True) -> None:
        self._rng = micro_batch_rng(seed, m, stage, rows) if keyed else nullcontext()
        self._norms = norms_running_stats(norms, update_bn)

    def __enter__(self) -> None:
        self._rng.__enter__()
        try:
            self._norms.__enter__()
        except BaseException:
            self._rng.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self._norms.__exit__(*exc)
        finally:
            self._rng.__exit__(*exc)


#: the scope of a stage with nothing to key and no batch norm (most LLMs): shared, it does nothing
NO_SCOPE = nullcontext()

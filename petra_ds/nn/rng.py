"""Keyed random streams.

A reversible layer evaluates its F and G twice per micro-batch: once in the forward and once in the
reconstruction, clocks later, after other micro-batches went through the same layer. Any stochastic op
inside (dropout, drop-path, LSH rotations) must draw the same numbers both times, so the generator
state is derived from (seed, micro-batch, stage, replica, layer, branch) instead of taken from the global
stream or from a per-layer attribute that the next micro-batch would overwrite.

The replica part keys a block of rows of the global micro-batch: replica r of D holds rows r*b .. (r+1)*b - 1
and draws as block r. A run resumed on another data-parallel degree keeps its blocks (:class:`RowBlocks`): a
replica holding several blocks, or part of one, draws each block's numbers from that block's key
(``row_draws.py``), so the masks are those the uninterrupted run drew.
"""

from __future__ import annotations

import functools
import threading
import warnings
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator, NamedTuple, Sequence, TypeVar

import torch
from torch import Tensor

from .draws import may_draw
from .row_draws import SplitDraws

T = TypeVar("T")

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*key: int) -> int:
    """A 63-bit seed that depends on every part of ``key`` and on their order."""
    return _fold(_START, key) & _MASK63


_START = 0x243F6A8885A308D3


def _fold(h: int, parts: Sequence[int]) -> int:
    """The hash of a key continued by ``parts`` (a key's hash is its parts folded in order, from ``_START``)."""
    for part in parts:
        h = _splitmix64(h ^ (int(part) & _MASK64))
    return h


#: keys a run meets again (a micro-batch's at its forward, reconstruction and backward; a layer's at its forward and
#: reconstruction): their hashes remembered, a pure function's, as many as a deep pipeline has in flight
_KEYS_REMEMBERED = 1 << 14


@functools.lru_cache(maxsize=_KEYS_REMEMBERED)
def _fold_remembered(h: int, parts: tuple[int, ...]) -> int:
    """:func:`_fold`, remembered: a stage opens a micro-batch's scope at every instruction about it, and a layer's
    at its forward and its reconstruction."""
    return _fold(h, parts)


class RowBlocks(NamedTuple):
    """The keyed row blocks of a global micro-batch that one replica holds: blocks ``first`` ..
    ``first + count - 1`` whole, or (``parts`` > 1) part ``part`` of ``parts`` of block ``first``. A run's
    blocks are its first data-parallel degree's replicas; ``RowBlocks(r)`` is replica r of that degree."""

    first: int
    count: int = 1
    part: int = 0
    parts: int = 1

    @property
    def whole(self) -> bool:
        """One whole block: the replica draws as one, with no splitting."""
        return self.count == 1 and self.parts == 1


class _Scope(threading.local):
    key: tuple[int, ...] | None = None
    folded: int = 0  # the hash of ``key`` (see ``_fold``), so that a layer's seed folds two more parts only
    generators: tuple = ()  # the generators the scope seeds, found once per micro-batch scope, not per layer
    rows: RowBlocks | None = None  # the replica's blocks, when it holds other than one whole block
    blocks: tuple[int, ...] = ()  # the hash of each block's micro-batch key, under ``rows``
    draws: "BlockDraws | None" = None  # the innermost keyed scope's per-block streams, under ``rows``


_scope = _Scope()
#: what a layer runs under outside any micro-batch scope: the global stream
_GLOBAL_STREAM = nullcontext()


def current_key() -> tuple[int, ...] | None:
    """The (seed, micro_batch, stage, replica) key of the enclosing :func:`micro_batch_rng`, if any."""
    return _scope.key


def _default_devices() -> list[int]:
    """The CUDA device whose generator a keyed scope forks: the current one once CUDA is initialised (so it is
    available). ``torch.cuda.is_available()`` is not asked: a CUDA build on a machine without a GPU answers it
    by loading NVML anew on every call, 2-3% of a CPU rank's time at two calls per layer and micro-batch."""
    return [torch.cuda.current_device()] if torch.cuda.is_initialized() else []


@contextmanager
def keyed_rng(*key: int, devices: Sequence[int] | None = None) -> Iterator[None]:
    """Run the body on generator states seeded from ``key``; the global streams are restored after."""
    with _Seeded(derive_seed(*key), _generators(_default_devices() if devices is None else list(devices))):
        yield


#: a generator's state, read without a comprehension's frame (a keyed scope opens twice per layer and micro-batch)
_GET_STATE = torch.Generator.get_state


class _Seeded:
    """``torch.random.fork_rng(devices)`` then ``torch.manual_seed(seed)`` on those generators, without
    fork_rng's checks and device lookups, and as a class rather than a generator function: a keyed scope is
    entered twice per layer and micro-batch."""

    __slots__ = ("_seed", "_generators", "_saved")

    def __init__(self, seed: int, generators: Sequence[torch.Generator]) -> None:
        self._seed = seed
        self._generators = generators

    def __enter__(self) -> None:
        self._saved = list(map(_GET_STATE, self._generators))
        for generator in self._generators:
            generator.manual_seed(self._seed)

    def __exit__(self, *exc: object) -> None:
        for generator, state in zip(self._generators, self._saved):
            generator.set_state(state)


def _generators(devices: Sequence[int]) -> tuple[torch.Generator, ...]:
    """The CPU generator and those of CUDA ``devices``."""
    if devices:
        torch.cuda.init()  # the generators exist once CUDA is (a no-op then)
    return (torch.random.default_generator, *(torch.cuda.default_generators[d] for d in devices))


class micro_batch_rng:
    """Everything a stage computes for one micro-batch runs under this scope.

    Ops outside reversible layers draw from the (seed, micro_batch, stage, replica) stream, so a
    non-reversible stage's recomputation matches its forward; reversible layers derive their own
    per-layer streams from the same key (see :func:`layer_rng`). Data-parallel replicas see different
    data under the same micro-batch index, so ``replica`` gives each its own masks: an index (one whole row
    block) or the :class:`RowBlocks` it holds after a change of data-parallel degree. A class, not a generator
    function: a stage enters it at every instruction.
    """

    __slots__ = ("_key", "_rows", "_previous", "_seeded", "_split")

    def __init__(self, seed: int, micro_batch: int, stage: int, replica: int | RowBlocks = 0) -> None:
        rows = replica if isinstance(replica, RowBlocks) else RowBlocks(int(replica))
        self._key = (int(seed), int(micro_batch), int(stage), rows.first)
        self._rows = None if rows.whole else rows

    def __enter__(self) -> None:
        self._previous = _scope.key, _scope.folded, _scope.generators, _scope.rows, _scope.blocks, _scope.draws
        _scope.key, _scope.folded = self._key, _fold_remembered(_START, self._key)
        _scope.generators = _generators(_default_devices())
        self._seeded = _Seeded(_scope.folded & _MASK63, _scope.generators)
        self._seeded.__enter__()
        rows = _scope.rows = self._rows
        self._split = None
        if rows is not None:
            blocks = range(rows.first, rows.first + rows.count)
            _scope.blocks = tuple(_fold(_START, (*self._key[:3], b)) for b in blocks)
            _scope.draws = BlockDraws(rows, _scope.blocks, _scope.generators)
            self._split = SplitDraws(current_draws)
            self._split.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            if self._split is not None:
                self._split.__exit__(*exc)
                _scope.draws.check()
            self._seeded.__exit__(*exc)
        finally:
            _scope.key, _scope.folded, _scope.generators, _scope.rows, _scope.blocks, _scope.draws = self._previous


def layer_rng(layer: int, branch: int, module: object = None) -> ContextManager[None]:
    """Stream for one branch (F = 0, G = 1, ...) of one layer, inside the current micro-batch scope;
    ``module``: the branch's, when nothing under it draws (``draws.may_draw``) there is nothing to key.

    Outside any :func:`micro_batch_rng` scope the global stream is used, as plain PyTorch would: that
    is the behaviour that makes a reconstruction with dropout inexact.
    """
    if _scope.key is None or (module is not None and not may_draw(module)):
        return _GLOBAL_STREAM
    seeded = _Seeded(_fold_remembered(_scope.folded, (layer, branch)) & _MASK63, _scope.generators)
    if _scope.rows is None:
        return seeded
    return _LayerBlocks(seeded, tuple(_fold(h, (layer, branch)) for h in _scope.blocks))


def current_draws() -> "BlockDraws | None":
    """The innermost keyed scope's per-block streams, when the replica holds other than one whole row block."""
    return _scope.draws


class BlockDraws:
    """One keyed scope's streams, one per row block the replica holds, each continuing where its last draw
    left it. The generators themselves stay on the scope's own seeded state between draws, so a random op that
    is not split by rows (``row_draws.py`` splits dropout and attention dropout) is seen as a change of that
    state and named once."""

    def __init__(self, rows: RowBlocks, blocks: Sequence[int], generators: Sequence[torch.Generator]) -> None:
        self.rows, self.generators = rows, generators
        self.seeds = [h & _MASK63 for h in blocks]
        self.states: list[list[Tensor] | None] = [None] * len(self.seeds)
        self.home = [g.get_state() for g in generators]

    def run(self, block: int, draw: Callable[[], T]) -> T:
        """``draw()`` on the stream of the ``block``-th block the replica holds (0-based)."""
        self.check()
        state = self.states[block]
        for i, generator in enumerate(self.generators):
            if state is None:
                generator.manual_seed(self.seeds[block])
            else:
                generator.set_state(state[i])
        try:
            return draw()
        finally:
            self.states[block] = [g.get_state() for g in self.generators]
            for generator, home in zip(self.generators, self.home):
                generator.set_state(home)

    def check(self) -> None:
        """Name, once per process, a draw that was not split by rows (and go back to the scope's state)."""
        global _warned_unsplit
        for generator, home in zip(self.generators, self.home):
            if not torch.equal(generator.get_state(), home):
                if not _warned_unsplit:
                    _warned_unsplit = True
                    warnings.warn(
                        "a random op other than dropout or attention dropout drew numbers on a replica that holds "
                        "the rows of several data-parallel replicas, or part of one's (a run resumed on another "
                        "data-parallel degree): its numbers are not those the uninterrupted run drew, but another, "
                        "equally valid sample. Keyed draws by rows cover torch's dropout functions and "
                        "scaled_dot_product_attention's dropout_p", stacklevel=2)
                generator.set_state(home)


_warned_unsplit = False


class _LayerBlocks:
    """A layer's keyed scope on a replica that holds several row blocks or part of one: its own seeded state
    (as with one block) and one stream per block."""

    __slots__ = ("_seeded", "_blocks", "_previous")

    def __init__(self, seeded: _Seeded, blocks: tuple[int, ...]) -> None:
        self._seeded, self._blocks = seeded, blocks

    def __enter__(self) -> None:
        self._seeded.__enter__()
        self._previous = _scope.draws
        _scope.draws = BlockDraws(_scope.rows, self._blocks, _scope.generators)

    def __exit__(self, *exc: object) -> None:
        try:
            _scope.draws.check()
        finally:
            _scope.draws = self._previous
            self._seeded.__exit__(*exc)

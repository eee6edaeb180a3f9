"""Keyed random streams.

A reversible layer evaluates its F and G twice per micro-batch: once in the forward and once in the
reconstruction, clocks later, after other micro-batches went through the same layer. Any stochastic op
inside (dropout, drop-path, LSH rotations) must draw the same numbers both times, so the generator
state is derived from (seed, micro-batch, stage, replica, layer, branch) instead of taken from the global
stream or from a per-layer attribute that the next micro-batch would overwrite.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator, Sequence

import torch

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


class _Scope(threading.local):
    key: tuple[int, ...] | None = None
    folded: int = 0  # the hash of ``key`` (see ``_fold``), so that a layer's seed folds two more parts only
    generators: tuple = ()  # the generators the scope seeds, found once per micro-batch scope, not per layer


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


class _Seeded:
    """``torch.random.fork_rng(devices)`` then ``torch.manual_seed(seed)`` on those generators, without
    fork_rng's checks and device lookups, and as a class rather than a generator function: a keyed scope is
    entered twice per layer and micro-batch."""

    __slots__ = ("_seed", "_generators", "_saved")

    def __init__(self, seed: int, generators: Sequence[torch.Generator]) -> None:
        self._seed = seed
        self._generators = generators

    def __enter__(self) -> None:
        self._saved = [g.get_state() for g in self._generators]
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
    data under the same micro-batch index, so ``replica`` gives each its own masks. A class, not a generator
    function: a stage enters it at every instruction.
    """

    __slots__ = ("_key", "_previous", "_seeded")

    def __init__(self, seed: int, micro_batch: int, stage: int, replica: int = 0) -> None:
        self._key = (int(seed), int(micro_batch), int(stage), int(replica))

    def __enter__(self) -> None:
        self._previous = _scope.key, _scope.folded, _scope.generators
        _scope.key, _scope.folded = self._key, _fold(_START, self._key)
        _scope.generators = _generators(_default_devices())
        self._seeded = _Seeded(_scope.folded & _MASK63, _scope.generators)
        self._seeded.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self._seeded.__exit__(*exc)
        finally:
            _scope.key, _scope.folded, _scope.generators = self._previous


def layer_rng(layer: int, branch: int) -> ContextManager[None]:
    """Stream for one branch (F = 0, G = 1, ...) of one layer, inside the current micro-batch scope.

    Outside any :func:`micro_batch_rng` scope the global stream is used, as plain PyTorch would: that
    is the behaviour that makes a reconstruction with dropout inexact.
    """
    if _scope.key is None:
        return _GLOBAL_STREAM
    return _Seeded(_fold(_scope.folded, (layer, branch)) & _MASK63, _scope.generators)

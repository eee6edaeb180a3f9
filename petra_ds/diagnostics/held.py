"""What a pipeline stage holds between two clocks, measured on the real engines.

A stage's memory beyond its model and optimizer is what it keeps alive for training in flight: the
tensors autograd saved for a backward that has not run yet, plus the engine's own buffers (PETRA's
input FIFO, stage 0's raw micro-batches, the parameter stash of the weight-stashing ablation, messages
waiting for the next clock; DeepSpeed's ``pipe_buffers`` and receive buffers for its 1F1B schedule).

:class:`HeldTracker` records every tensor autograd saves (``saved_tensors_hooks``) through a weak
reference, so it sees exactly those a live graph still holds. :meth:`HeldTracker.measure` adds the bytes
of the distinct storages (a storage shared by several views or several categories counts once, in the
first category that names it; parameters never count), at any point the caller picks: the end of every
PETRA clock (``engine.clock_observers``) or after every step of DeepSpeed's schedule
(:class:`StepObserved`). Both engines' buffers are read through views they offer: PETRA's
``engine.holdings(stage)``, the one its memory ledger counts, and :meth:`StepObserved.held_buffers`.

``benchmarks/lib/memory_worker.py`` runs PETRA, its two delayed-gradient ablations and DeepSpeed's 1F1B with
it on the same RevGPT layers, one stage per process; ``python -m benchmarks.memory`` turns the traces into the
table and the plot.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor

from ..runtime.engine import PetraEngine
from ..runtime.ledger import storage, storage_bytes, storage_keys
from ..util.nested import tensors_in

#: categories of held bytes, in the order a shared storage is attributed
BUFFER_CATEGORIES = ("data", "inputs", "outputs", "param_stash", "messages")
#: what :meth:`HeldTracker.measure` returns: the buffers, then what only autograd's graphs hold
CATEGORIES = (*BUFFER_CATEGORIES, "graph")
#: activations proper: a stage's inputs and outputs kept for a backward, and the graphs' saved tensors
ACTIVATION_CATEGORIES = ("inputs", "outputs", "graph")

class HeldTracker:
    """Weak references to every tensor autograd saves while :meth:`recording` is active.

    It also keeps a running total of the distinct storages saved tensors hold now (``live_bytes``) and
    its maximum (``peak_bytes``): the graph's high-water mark *inside* a clock, where
    :meth:`measure` sees only what outlives one. Storages of ``exclude`` (the parameters) never count."""

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._saved: list[weakref.ref] = []
        self._exclude = storage_keys(exclude)
        self._live: dict[tuple[str, int], list[int]] = {}  # storage -> [saved tensors alive, bytes]
        self._lock = threading.Lock()  # autograd may free saved tensors on its own threads (CUDA)
        self.live_bytes = 0
        self.peak_bytes = 0

    @contextmanager
    def recording(self) -> Iterator["HeldTracker"]:
        """Install the hooks (thread-local, like autograd's own) for the duration of the block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self

    def _pack(self, t: Tensor) -> Tensor:
        # a detached alias: the graph keeps it (and its storage) exactly as long as it would keep ``t``,
        # without the reference cycle that saving an output tensor with its own grad_fn would create
        saved = t.detach()
        if saved.layout != torch.strided:  # no single storage to count (sparse, nested): left out
            return saved
        key, nbytes = storage(saved)
        if key in self._exclude:
            self._saved.append(weakref.ref(saved))
            return saved
        with self._lock:
            entry = self._live.setdefault(key, [0, nbytes])
            entry[0] += 1
            if entry[0] == 1:
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._saved.append(weakref.ref(saved, functools.partial(self._release, key)))
        return saved

    def _release(self, key: tuple[str, int], _ref: weakref.ref) -> None:
        with self._lock:
            entry = self._live[key]
            entry[0] -= 1
            if entry[0] == 0:
                del self._live[key]
                self.live_bytes -= entry[1]

    def reset_peak(self) -> int:
        """The peak since the last reset; the next one starts from what is live now."""
        with self._lock:
            peak, self.peak_bytes = self.peak_bytes, self.live_bytes
        return peak

    def saved(self) -> list[Tensor]:
        """The saved tensors some graph still holds (forgets the others)."""
        alive = [(ref, ref()) for ref in self._saved]
        alive = [(ref, t) for ref, t in alive if t is not None]
        self._saved = [ref for ref, _ in alive]
        return [t for _, t in alive]

    def measure(self, buffers: dict[str, Any], exclude: Iterable[Tensor] = ()) -> dict[str, int]:
        """Bytes per category of ``buffers`` (nested tensors), then ``"graph"``: the saved tensors no
        buffer holds. Distinct storages only; storages of ``exclude`` (the parameters) never count."""
        seen = self._exclude | storage_keys(exclude)
        return {name: storage_bytes(obj, seen) for name, obj in [*buffers.items(), ("graph", self.saved())]}


def _unpack(t: Tensor) -> Tensor:
    return t


def activations(measured: dict[str, int]) -> int:
    return sum(measured.get(c, 0) for c in ACTIVATION_CATEGORIES)


# --- what each engine keeps between clocks ---

def petra_buffers(engine: PetraEngine, stage: int) -> dict[str, Any]:
    """PETRA stage ``stage``'s buffers by category: the engine's read-only view, the one its memory
    ledger counts too."""
    return engine.holdings(stage).categories()


class StepObserved:
    """A mixin for DeepSpeed's ``PipelineEngine``: after every step of every schedule it executes, each
    of ``pipeline_step_observers`` is called as ``f(engine, step)`` (``step`` counts over the run)."""

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        if not hasattr(self, "pipeline_step_observers"):
            self.pipeline_step_observers: list[Callable[[Any, int], None]] = []
        steps = self.__dict__.setdefault("_observed_steps", itertools.count())

        def after_step() -> None:
            step = next(steps)
            for observe in self.pipeline_step_observers:
                observe(self, step)

        super()._exec_schedule(_ObservedSchedule(pipe_schedule, after_step))

    def held_buffers(self) -> dict[str, Any]:
        """DeepSpeed's pipeline buffers by category: stage 0's ``inputs`` are data, the others' are
        received activations kept for the backward (their ``.grad``, waiting for ``SendGrad``, is a
        message)."""
        pb = self.pipe_buffers
        received = [] if self.is_first_stage() else pb["inputs"]
        input_grads = [t.grad for t in tensors_in(received) if t.grad is not None]
        return {
            "data": [pb["labels"], pb["inputs"] if self.is_first_stage() else []],
            "inputs": received,
            "outputs": [pb["outputs"], pb["output_tensors"]],
            "param_stash": [],
            "messages": [self.pipe_recv_buf, self.grad_layer, self._grad_layer_buf, self.meta_buffer, input_grads],
        }


class _ObservedSchedule:
    """A DeepSpeed schedule whose iteration calls ``after_step`` once each step's commands have run."""

    def __init__(self, schedule: Any, after_step: Callable[[], None]) -> None:
        self._schedule = schedule
        self._after_step = after_step

    def __iter__(self) -> Iterator[list]:
        for cmds in self._schedule:
            yield cmds
            self._after_step()  # the engine asks for the next step only after running this one

    def __getattr__(self, name: str) -> Any:
        return getattr(self._schedule, name)


def observed_pipeline_engine(model: Any, config: dict[str, Any]) -> Any:
    """DeepSpeed's 1F1B ``PipelineEngine`` for ``model``, with :class:`StepObserved`, built the way
    ``deepspeed.initialize`` builds it."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class ObservedPipelineEngine(StepObserved, PipelineEngine):
        pass

    mpu = model.mpu()
    return ObservedPipelineEngine(args=None, model=model, mpu=mpu, config=config,
                                  config_class=DeepSpeedConfig(config, mpu))

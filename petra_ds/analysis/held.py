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

:func:`run_rank` / :func:`launch` run PETRA, its two delayed-gradient ablations and DeepSpeed's 1F1B on
the same RevGPT layers, one stage per process, and return every stage's trace; ``benchmarks/memory.py``
turns them into the table and the plot.
"""

from __future__ import annotations

import functools
import gc
import itertools
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor

from ..module import layer_module

#: categories of held bytes, in the order a shared storage is attributed
BUFFER_CATEGORIES = ("data", "inputs", "outputs", "param_stash", "messages")
#: what :meth:`HeldTracker.measure` returns: the buffers, then what only autograd's graphs hold
CATEGORIES = (*BUFFER_CATEGORIES, "graph")
#: activations proper: a stage's inputs and outputs kept for a backward, and the graphs' saved tensors
ACTIVATION_CATEGORIES = ("inputs", "outputs", "graph")

#: the four training methods: PETRA, delayed gradients + checkpointing (Xu et al. / Kosson et al.),
#: standard delayed gradients (PipeDream: inputs and weights stashed), DeepSpeed's 1F1B backprop
METHODS: dict[str, dict[str, Any] | None] = {
    "petra": {},
    "delayed_ckpt": {"input_buffer": "all"},
    "delayed_stash": {"input_buffer": "all", "param_buffer": True},
    "1f1b": None,
}


def tensors_in(obj: Any) -> Iterator[Tensor]:
    """Every tensor inside nested tuples, lists, deques and dict values."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (tuple, list, deque)):
        for v in obj:
            yield from tensors_in(v)


def _storage(t: Tensor) -> tuple[tuple[str, int], int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr()), storage.nbytes()


class HeldTracker:
    """Weak references to every tensor autograd saves while :meth:`recording` is active.

    It also keeps a running total of the distinct storages saved tensors hold now (``live_bytes``) and
    its maximum (``peak_bytes``): the graph's high-water mark *inside* a clock, where
    :meth:`measure` sees only what outlives one. Storages of ``exclude`` (the parameters) never count."""

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._saved: list[weakref.ref] = []
        self._exclude = {_storage(t)[0] for t in exclude}
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
        key, nbytes = _storage(saved)
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
        seen = self._exclude | {_storage(t)[0] for t in exclude}
        out = {}
        for name, obj in [*buffers.items(), ("graph", self.saved())]:
            total = 0
            for t in tensors_in(obj):
                key, nbytes = _storage(t)
                if key not in seen:
                    seen.add(key)
                    total += nbytes
            out[name] = total
        return out


def _unpack(t: Tensor) -> Tensor:
    return t


def activations(measured: dict[str, int]) -> int:
    return sum(measured.get(c, 0) for c in ACTIVATION_CATEGORIES)


# --- what each engine keeps between clocks ---

def petra_buffers(engine: Any, stage: int) -> dict[str, Any]:
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


# --- the four methods on one RevGPT, one stage per process ---

DEFAULT_SPEC: dict[str, Any] = {
    "J": 3, "k": None, "micro_batch": 4, "train_batches": 3, "layers_per_stage": 2,
    "vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 2, "mlp_ratio": 4, "dropout": 0.1,
    "methods": list(METHODS), "seed": 0, "ledger": True, "trace": True,
}


def revgpt_for(spec: dict[str, Any]) -> Any:
    """A RevGPT with ``layers_per_stage`` x J layers (embedding, blocks, final norm, head): under the
    uniform partition stage 0 is the embedding and one block, the last stage the norm and the head, and
    every middle stage the same ``layers_per_stage`` reversible blocks whatever J."""
    from ..models.transformer import RevGPTConfig

    n_layers = spec["layers_per_stage"] * spec["J"] - 3
    if n_layers < 1:
        raise ValueError(f"J={spec['J']} x layers_per_stage={spec['layers_per_stage']} leaves no transformer block")
    return RevGPTConfig(vocab_size=spec["vocab_size"], seq_len=spec["seq_len"], d_model=spec["d_model"],
                        n_layers=n_layers, n_heads=spec["n_heads"], mlp_ratio=spec["mlp_ratio"],
                        dropout=spec["dropout"])


def token_stream(spec: dict[str, Any]) -> Iterator[tuple[Tensor, Tensor]]:
    """Fresh (ids, next ids) tensors for every micro-batch: two micro-batches never share a storage."""
    g = torch.Generator().manual_seed(spec["seed"])
    while True:
        ids = torch.randint(0, spec["vocab_size"], (spec["micro_batch"], spec["seq_len"] + 1), generator=g)
        yield ids[:, :-1].clone(), ids[:, 1:].clone()


def _engine(method: str, spec: dict[str, Any]) -> Any:
    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    import petra_ds

    from ..models.transformer import lm_loss, revgpt_layers

    layers = revgpt_layers(revgpt_for(spec))
    topology = PipeDataParallelTopology(num_pp=spec["J"], num_dp=1)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"], "gradient_accumulation_steps": spec["k"],
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**9,
    }
    if METHODS[method] is None:
        model = PipelineModule(layers, topology=topology, loss_fn=lm_loss, partition_method="uniform",
                               seed_layers=True, base_seed=spec["seed"])
        return observed_pipeline_engine(model, config)
    model = petra_ds.PetraPipelineModule(layers, topology=topology, loss_fn=lm_loss, stages_per_rank=1,
                                         partition_method="uniform", base_seed=spec["seed"])
    config["petra"] = {"stages_per_rank": 1, **METHODS[method]}
    engine, *_ = petra_ds.initialize(model=model, config=config)
    return engine


def measure_method(method: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``train_batches`` x k micro-batches with ``method`` on this rank's stage; return the bytes
    held after every clock (PETRA) or schedule step (1F1B), their peaks, and PETRA's ledger."""
    engine = _engine(method, spec)
    petra = METHODS[method] is not None
    stage = engine.stage_id
    params = list(engine.module.parameters())
    tracker = HeldTracker(exclude=params)
    trace: list[dict[str, Any]] = []
    ledger_mismatch: list[dict[str, Any]] = []

    def observe(eng: Any, at: int) -> None:
        if petra:
            held = tracker.measure(petra_buffers(eng, stage))
            st = eng.stages[stage]
            row = {"at": at, **held, "fifo": len(st.fifo), "raw": len(st.raw), "stash": len(st.stash)}
            if spec["ledger"]:
                ledger = eng.memory_report()[stage]
                row["ledger"] = {key: ledger[key] for key in
                                 ("input_buffer", "raw_micro_batches", "param_buffer", "messages")}
                pairs = (("inputs", "input_buffer"), ("data", "raw_micro_batches"), ("param_stash", "param_buffer"),
                         ("messages", "messages"))
                if any(held[a] != ledger[b] for a, b in pairs):
                    ledger_mismatch.append(row)
        else:
            row = {"at": at, **tracker.measure(eng.held_buffers())}
        row["activations"] = activations(row)
        row["graph_transient"] = tracker.reset_peak()  # the graph's high-water mark since the last observation
        trace.append(row)

    if petra:
        engine.clock_observers.append(observe)
    else:
        engine.pipeline_step_observers = [observe]
    data = token_stream(spec)
    cuda = engine.device.type == "cuda"
    if cuda:  # the model, its gradients and optimizer state exist after a first batch (and a drain)
        engine.train_batch(data)
        if petra:
            engine.drain()
        torch.cuda.synchronize(engine.device)
        baseline = torch.cuda.memory_allocated(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
        trace.clear()
    with tracker.recording():
        for _ in range(spec["train_batches"]):
            engine.train_batch(data)
    result: dict[str, Any] = {
        "method": method, "stage": stage, "steps": len(trace),
        "peak": {c: max(r[c] for r in trace) for c in (*CATEGORIES, "activations", "graph_transient")},
        "peak_held": max(sum(r[c] for c in CATEGORIES) for r in trace),
        "first_activations": next((r["activations"] for r in trace if r["activations"]), 0),
        "layers": [type(layer_module(f) or f).__name__ for f in engine.module.forward_funcs],
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "reconstructs": bool(petra and engine.stages[stage].reconstructs),
        "cuda_peak_minus_baseline": (torch.cuda.max_memory_allocated(engine.device) - baseline) if cuda else
        "not run: CPU process, no CUDA device",
    }
    if petra:
        result["peak_in_flight"] = {key: max(r[key] for r in trace) for key in ("fifo", "raw", "stash")}
        result["ledger_mismatches"] = ledger_mismatch
        report = engine.memory_report()[stage]
        result["ledger_peaks"] = {key: report[key] for key in ("input_buffer_peak", "param_buffer_peak")}
        result["model_bytes"] = {key: report[key] for key in ("params", "optimizer_state")}
    if spec["trace"]:  # one list per category, indexed like the clocks / steps observed
        result["trace"] = {c: [r[c] for r in trace] for c in ("at", *CATEGORIES, "activations", "graph_transient")}
    del engine
    gc.collect()
    return result


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """In a process launched as one rank of J: every method of ``spec["methods"]`` in turn."""
    import petra_ds
    from deepspeed import comm as dist

    spec = {**DEFAULT_SPEC, **spec}
    spec["k"] = spec["k"] or spec["J"]
    petra_ds.init_distributed(dist_backend=spec.get("backend", "gloo"))
    torch.manual_seed(spec["seed"])
    out = {}
    for method in spec["methods"]:
        out[method] = measure_method(method, spec)
        dist.barrier()
    return out


def launch(spec: dict[str, Any], timeout: float = 600, grace: float = 10) -> list[dict[str, Any]]:
    """Run :func:`run_rank` in ``spec["J"]`` fresh processes (gloo unless ``spec["backend"]``); their
    results by rank (= stage). A rank that fails stops the others ``grace`` seconds later (they would
    otherwise wait for it until ``timeout``)."""
    from ..spawn import launch as launch_processes

    return launch_processes(spec, {**DEFAULT_SPEC, **spec}["J"], timeout, grace, target=run_rank)

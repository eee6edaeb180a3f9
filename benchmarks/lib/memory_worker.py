"""The held-memory benchmark's worker (``python -m benchmarks.memory``): PETRA, its two delayed-gradient ablations
and DeepSpeed's 1F1B on one RevGPT, one stage per process, each stage measuring what it holds after every clock
(PETRA) or schedule step (1F1B) with ``petra_ds.diagnostics.held``'s tracker; :func:`launch` returns every stage's
trace. The processes are started by reference to :func:`run_rank` (``petra_ds.tools.spawn``) and import this module
through the caller's import path, which holds the repository root."""

from __future__ import annotations

import gc
from contextlib import nullcontext
from typing import Any, Iterator

import torch
from torch import Tensor

from petra_ds.diagnostics.allocated import AllocatedStorages
from petra_ds.diagnostics.held import (CATEGORIES, HeldTracker, activations, observed_pipeline_engine,
                                       petra_buffers)
from petra_ds.pipeline.module import layer_module

#: the four training methods: PETRA, delayed gradients + checkpointing (Xu et al. / Kosson et al.),
#: standard delayed gradients (PipeDream: inputs and weights stashed), DeepSpeed's 1F1B backprop
METHODS: dict[str, dict[str, Any] | None] = {
    "petra": {},
    "delayed_ckpt": {"input_buffer": "all"},
    "delayed_stash": {"input_buffer": "all", "param_buffer": True},
    "1f1b": None,
}


DEFAULT_SPEC: dict[str, Any] = {
    "J": 3, "k": None, "micro_batch": 4, "train_batches": 3, "layers_per_stage": 2,
    "vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 2, "mlp_ratio": 4, "dropout": 0.1,
    "methods": list(METHODS), "seed": 0, "ledger": True, "trace": True,
}


def revgpt_for(spec: dict[str, Any]) -> Any:
    """A RevGPT with ``layers_per_stage`` x J layers (embedding, blocks, final norm, head): under the
    uniform partition stage 0 is the embedding and one block, the last stage the norm and the head, and
    every middle stage the same ``layers_per_stage`` reversible blocks whatever J."""
    from petra_ds.models.transformer import RevGPTConfig

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

    from petra_ds.models.transformer import lm_loss, revgpt_layers

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
    parts = AllocatedStorages.training_parts(params, engine.optimizer)
    allocated = nullcontext() if cuda else AllocatedStorages(parts)  # a GPU reports its allocator's peak
    with tracker.recording(), allocated:
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
        "allocated": "on CUDA: cuda_peak_minus_baseline" if cuda else
        {"peak": allocated.peak_bytes, "parts": allocated.peak_parts},
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
    from deepspeed import comm as dist

    import petra_ds

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
    from petra_ds.tools.spawn import launch as launch_processes

    return launch_processes(spec, {**DEFAULT_SPEC, **spec}["J"], timeout, grace, target=run_rank)

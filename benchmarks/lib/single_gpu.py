"""PETRA on one CUDA device: peak memory and step time against plain backprop, and
``petra.reconstruct_overlap`` on vs off.

    python -m benchmarks.gpu                        # a GPU: RevNet18 and RevGPT, fp32 and bf16 (--dtypes fp16)
    python -m benchmarks.gpu --device cpu --tiny    # smoke run of every code path on CPU (< 1 min)

One process, a world of one (NCCL on CUDA, gloo on CPU) hosting all J PETRA stages: the paper's
single-GPU setting. Per model and dtype, the variants run interleaved over ``--rounds`` rounds, each
freshly built:

    plain          the same layers, one forward and backward per micro-batch, k micro-batches per step
    petra          PetraEngine with J stages in this process, timed once the pipeline is full
    petra_overlap  the same with "petra": {"reconstruct_overlap": true}
    petra_unchecked  petra with "petra": {"check_finite": false} (what the NaN / Inf watch costs)
    petra_offload  petra with "petra": {"fifo_offload": "cpu"} (the FIFOs in pinned host memory between clocks)
    petra_offload_auto  petra with "petra": {"fifo_offload": "auto"} (only the stages whose copies hide). Not run
                   unless named: on an H100 it offloaded every stage "cpu" does
    petra_offload_messages  petra_offload with "message_offload": "cpu" too (the messages between stages in host
                   memory between their send and the instruction before their reader)
    petra_compiled  petra with "petra": {"compile": true} (inductor; its compiling falls in the warm-up calls).
                   Not run unless named in ``--variants``: compiling takes minutes
    petra_graphs   petra with "petra": {"cuda_graphs": true} (each part's graphs captured in the warm-up calls).
                   Not run unless named in ``--variants``

RevNet18 takes the paper's partition (J = 10, one layer per stage: each reconstructing stage holds one
block, so the overlap has nothing to hide there); RevGPT's J = 4 stages hold 3 blocks each (its middle
two reconstruct). All use torch's fused AdamW, gradient clipping at norm 1 and the same micro-batches.
``--channels-last`` puts RevNet18's weights and inputs in channels-last memory format for plain and PETRA alike
(PETRA's module converted before ``initialize``, as a user converts it).
Under bf16 or fp16 each layer of the plain model runs under autocast and its output goes back to fp32, as at a
PETRA stage boundary (fp32 streams: README, "bf16"). Reported per variant: seconds per ``train_batch``
(k micro-batches; the median of the calls of a round, then the median over rounds) and
``torch.cuda.max_memory_allocated`` over the timed calls minus what was allocated before the variant was
built (parameters, gradients and optimizer state included for both), and ``torch.cuda.max_memory_reserved`` likewise
(what ``nvidia-smi`` counts: the caching allocator's segments, fragmentation included). For PETRA also where the
bytes go: after the last call, ``engine.memory_report()`` summed over stages by part, the distinct device storages it
names with the benchmark's micro-batches (``explained_bytes``) against ``torch.cuda.memory_allocated``
(``allocated_after_bytes``), and the workspace (the peak less what stays allocated). Writes
``benchmarks/results/gpu_<device>.json``.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import itertools
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from typing import Any, Callable

import torch

from petra_ds.nn.casts import shares_casts
from petra_ds.runtime.observe import INSTRUCTION_LABEL
from petra_ds.util.files import write_text_atomic

from .example_runs import ROOT

MODELS = ("revnet18", "revgpt")
DTYPES = ("fp32", "bf16", "fp16")
#: what runs without ``--dtypes`` (fp16, for GPUs without bf16 arithmetic, when named)
DEFAULT_DTYPES = ("fp32", "bf16")
#: a dtype's autocast dtype (None: fp32, no autocast)
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: each PETRA variant's ``"petra"`` settings beside ``stages_per_rank``
PETRA_VARIANTS = {
    "petra": {}, "petra_overlap": {"reconstruct_overlap": True}, "petra_unchecked": {"check_finite": False},
    "petra_offload": {"fifo_offload": "cpu"},
    "petra_offload_messages": {"fifo_offload": "cpu", "message_offload": "cpu"},
    "petra_offload_auto": {"fifo_offload": "auto"}, "petra_compiled": {"compile": True},
    "petra_graphs": {"cuda_graphs": True}}
VARIANTS = ("plain", *PETRA_VARIANTS)
#: run only when named in ``--variants``
OPT_IN = ("petra_offload_auto", "petra_compiled", "petra_graphs")
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v not in OPT_IN)
#: every variant's optimizer: torch's fused AdamW (no JIT build; skips a non-finite step on the device), and clipping
OPTIMIZER = {"lr": 1e-4, "weight_decay": 0.01, "fused": True}
CLIPPING = 1.0
#: sizes: a real run on a GPU, and the smoke run (--tiny)
FULL = {"k": 4, "rounds": 3, "calls": 10,
        "revnet_batch": 128, "revnet_width": 64, "image_size": 32, "revnet_stages": 10,
        "revgpt_batch": 8, "d_model": 768, "layers": 12, "heads": 12, "seq_len": 512, "vocab_size": 8192,
        "revgpt_stages": 4}
TINY = {"k": 2, "rounds": 1, "calls": 2,
        "revnet_batch": 4, "revnet_width": 4, "image_size": 8, "revnet_stages": 10,
        "revgpt_batch": 2, "d_model": 16, "layers": 4, "heads": 2, "seq_len": 8, "vocab_size": 32,
        "revgpt_stages": 3}


def parse_args(argv: list[str]) -> argparse.Namespace:
    tiny = "--tiny" in argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small sizes, one round: checks the code paths")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DEFAULT_DTYPES),
                        help="fp16: plain backprop with torch's GradScaler, PETRA with its loss scale per stage")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    for name, value in (TINY if tiny else FULL).items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=value)
    parser.add_argument("--channels-last", action="store_true",
                        help="RevNet18's weights and inputs in channels-last memory format, plain and PETRA alike")
    parser.add_argument("--output", default=None, help="JSON report (default benchmarks/results/gpu_<device>.json)")
    return parser.parse_args(argv)


# --- models and data ---

def model(name: str, args: argparse.Namespace) -> tuple[list, Callable, str, int, int]:
    """(layer specs, loss_fn, partition method, J, micro-batch size)."""
    if name == "revnet18":
        from torch.nn import functional as F

        from petra_ds.models.revnet import revnet_layers

        specs = revnet_layers(18, num_classes=10, cifar=True, base_width=args.revnet_width)
        return specs, F.cross_entropy, "uniform", args.revnet_stages, args.revnet_batch
    from petra_ds.models.transformer import RevGPTConfig, lm_loss, revgpt_layers

    config = RevGPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                          n_layers=args.layers, n_heads=args.heads, dropout=0.0)
    return revgpt_layers(config), lm_loss, "type:RevGPTBlock", args.revgpt_stages, args.revgpt_batch


def micro_batches(name: str, args: argparse.Namespace, size: int, device: torch.device, count: int = 4) -> list:
    """A few fixed synthetic micro-batches (time and memory do not depend on their values)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        if name == "revnet18":
            x = torch.randn(size, 3, args.image_size, args.image_size, generator=g).to(device)
            if args.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            out.append((x, torch.randint(10, (size,), generator=g).to(device)))
        else:
            ids = torch.randint(args.vocab_size, (size, args.seq_len + 1), generator=g)
            out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out


def to_layout(module: torch.nn.Module, name: str, args: argparse.Namespace) -> None:
    """With ``--channels-last``, RevNet18's module to channels-last memory format, as a user converts it: plain's
    layers, and PETRA's module before ``initialize``."""
    if args.channels_last and name == "revnet18":
        module.to(memory_format=torch.channels_last)


def channels_last_share(module: torch.nn.Module) -> float:
    """The share of ``module``'s 4-D weights laid out channels-last, of those where the two layouts differ."""
    weights = [p for p in module.parameters()
               if p.dim() == 4 and not (p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last))]
    return sum(p.is_contiguous(memory_format=torch.channels_last) for p in weights) / max(len(weights), 1)


# --- measuring one variant ---

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceMemory:
    """The device's allocated bytes and their peak while a variant is built and run, above what was allocated
    before: ``torch.cuda``'s statistics on a GPU; on a CPU the allocator tracker
    (``petra_ds.diagnostics.allocated``), where the host copies of offloaded FIFOs and messages count apart, as
    pinned memory does on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tracker: Any = None
        self.before = 0

    def __enter__(self) -> "DeviceMemory":
        if self.device.type != "cuda":
            from petra_ds.diagnostics.allocated import AllocatedStorages

            self._tracker = AllocatedStorages().__enter__()
        self.before = self._allocated()
        self.reserved_before = torch.cuda.memory_reserved(self.device) if self._tracker is None else 0
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc)

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self._tracker is None else self._tracker.live_bytes

    def reset_peak(self) -> None:
        if self._tracker is None:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._tracker.reset_peak()

    def allocated(self) -> int:
        """Allocated now, above what was before."""
        return self._allocated() - self.before

    def peak(self) -> int:
        """The peak since :meth:`reset_peak`, above what was allocated before."""
        peak = torch.cuda.max_memory_allocated(self.device) if self._tracker is None else self._tracker.peak_bytes
        return peak - self.before

    def reserved_peak(self) -> int | None:
        """The caching allocator's reserved peak since :meth:`reset_peak`, above what it reserved before: what
        ``nvidia-smi`` counts, fragmentation included (None on a CPU, which has no caching allocator)."""
        if self._tracker is not None:
            return None
        return torch.cuda.max_memory_reserved(self.device) - self.reserved_before

    def host_peak(self) -> int | None:
        """The host copies' peak (None on a GPU, where ``torch.cuda`` does not count pinned memory)."""
        return None if self._tracker is None else self._tracker.peak_host_bytes

    def release(self) -> int:
        """Free what the variant left unreferenced; what stays allocated (a leak would skew the next variant)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.allocated()


def timed(train_batch: Callable[[], Any], warmup: int, calls: int, memory: DeviceMemory) -> dict:
    """Warm up, then time ``calls`` calls; the peak over the timed calls."""
    device = memory.device
    for _ in range(warmup):
        train_batch()
    _sync(device)
    memory.reset_peak()
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        train_batch()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    result = {"seconds_per_call": seconds, "median_seconds": statistics.median(seconds)}
    result.update(profiled(train_batch, device))
    result["peak_bytes"], result["allocated_after_bytes"] = memory.peak(), memory.allocated()
    result["host_peak_bytes"], result["reserved_peak_bytes"] = memory.host_peak(), memory.reserved_peak()
    return result


def profiled(train_batch: Callable[[], Any], device: torch.device) -> dict:
    """One more call under ``torch.profiler``: the device's kernel seconds, how long the device was busy, and the host's
    seconds less those it spent waiting for the device (synchronisations, and copies to the host, which wait for the
    stream): what the host needs to issue a call (``python -m benchmarks.gpu predict`` reads both; profiling slows the
    host somewhat). ``device_busy / wall`` near 1 says the call is device-bound, well below 1 host-bound."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as trace:
        start = time.perf_counter()
        train_batch()
        _sync(device)
        wall = time.perf_counter() - start
    events = trace.key_averages()
    waited = sum(e.self_cpu_time_total for e in events if "Synchronize" in e.key or e.key.startswith("cudaMemcpy"))
    launched = trace.events()
    return {"host_seconds": wall - waited / 1e6, "profiled_wall_seconds": wall, **kernel_summary(device_work(launched)),
            "host_by_instruction": host_by_instruction(events, launched), "host_by_op": host_by_op(launched, wall)}


def host_by_op(events: Any, wall: float, top: int = 20) -> dict:
    """Where the host's time in the profiled call went, by self time (an event's time less its children's): the
    calling thread's time outside every event (``outside_seconds``: the Python between ops for plain backprop, between
    instructions for PETRA, and on CUDA plain's wait in ``backward()``), its events' self time and the other threads'
    (autograd's device threads run a CUDA backward while the caller waits), and the ``top`` names by self time: torch
    ops, CUDA runtime calls (``cudaLaunchKernel``), autograd nodes, and the engine's instruction ranges by kind, whose
    self time is the Python inside them (and, for a backward on CUDA, its wait for autograd's thread). A host-bound
    call's Python is then told from its dispatch and launches. ``instructions_self_seconds`` sums those ranges' self
    time. The calling thread is the one whose event starts first."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    if not cpu:
        return {}
    caller = min(cpu, key=lambda e: e.time_range.start).thread
    self_seconds = {"caller": 0.0, "other": 0.0}
    names: dict[tuple[str, str], list[float]] = {}
    for e in cpu:
        side = "caller" if e.thread == caller else "other"
        name = INSTRUCTION_LABEL + _kind(e.name) if e.name.startswith(INSTRUCTION_LABEL) else e.name[:120]
        entry = names.setdefault((name, side), [0.0, 0])
        entry[0] += e.self_cpu_time_total / 1e6
        entry[1] += 1
        self_seconds[side] += e.self_cpu_time_total / 1e6
    ranked = sorted(names.items(), key=lambda item: -item[1][0])[:top]
    instructions = sum(seconds for (name, _), (seconds, _) in names.items() if name.startswith(INSTRUCTION_LABEL))
    return {"outside_seconds": max(wall - self_seconds["caller"], 0.0), "self_seconds": self_seconds,
            "instructions_self_seconds": instructions,
            "top": [{"name": name, "thread": side, "seconds": seconds, "count": int(count)}
                    for (name, side), (seconds, count) in ranked]}


def host_by_instruction(events: Any, launches: Any = ()) -> dict[str, dict]:
    """Per kind of engine instruction (its labelled ranges, "petra ForwardPass(...)"): the host's seconds and count,
    and the seconds of the kernels launched inside its ranges (``device_seconds``): what a clock's host time, and its
    device time, are spent on. ``events`` are the trace's averages by name; ``launches`` its events, whose kernels
    (``FunctionEvent.kernels``) count for the instruction whose range held their start on the host. By time, not by
    parent: the autograd engine launches a backward's kernels from its own thread, outside the range's tree. Empty
    for plain backprop, which has no instructions."""
    from torch.autograd import DeviceType

    kinds: dict[str, list[float]] = {}
    for e in events:
        if e.key.startswith(INSTRUCTION_LABEL) and e.device_type == DeviceType.CPU:
            entry = kinds.setdefault(_kind(e.key), [0.0, 0, 0.0])
            entry[0] += e.cpu_time_total / 1e6
            entry[1] += e.count
    ranges = sorted((e.time_range.start, e.time_range.end, _kind(e.name)) for e in launches
                    if e.device_type == DeviceType.CPU and e.name.startswith(INSTRUCTION_LABEL))
    starts = [start for start, _, _ in ranges]
    for e in launches:
        kernels = getattr(e, "kernels", None)
        if e.device_type != DeviceType.CPU or not kernels:
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i >= 0 and e.time_range.start < ranges[i][1]:
            kinds.setdefault(ranges[i][2], [0.0, 0, 0.0])[2] += sum(k.duration for k in kernels) / 1e6
    return {kind: {"seconds": seconds, "count": int(count), "device_seconds": device}
            for kind, (seconds, count, device) in sorted(kinds.items(), key=lambda item: -item[1][0])}


def _kind(label: str) -> str:
    """The instruction's class from its label ("petra ForwardPass(buffer_id=0)" -> "ForwardPass")."""
    return label[len(INSTRUCTION_LABEL):].split("(")[0]


def device_work(events: Any) -> list[tuple[str, float, float]]:
    """(name, start, end) in microseconds of each kernel, copy and fill the device ran. Not the labelled ranges (the
    engine's "petra ForwardPass(...)", torch's "Optimizer.step#..."): on the device each spans the kernels launched
    inside it, so counting them too counted those kernels twice (more kernel time than wall time on the H100)."""
    from torch.autograd import DeviceType

    return [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(INSTRUCTION_LABEL)]


#: kernel names grouped by what they compute, the first pattern that matches (lower case)
KERNEL_GROUPS = (("memcpy", ("memcpy",)), ("memset", ("memset",)),
                 ("convolution", ("conv", "fprop", "dgrad", "wgrad", "implicit", "winograd")),
                 ("matmul", ("gemm", "cutlass", "cublas", "nvjet", "xmma")),
                 ("attention", ("flash", "fmha", "attention", "sdpa")), ("optimizer", ("adam",)),
                 ("multi-tensor", ("multi_tensor", "foreach")), ("norm", ("norm", "welford", "bn_fw", "bn_bw")),
                 ("reduction", ("reduce",)),
                 ("cast", ("copy", "cast", "convert")), ("elementwise", ("elementwise", "vectorized")))


def kernel_group(name: str) -> str:
    lower = name.lower()
    return next((group for group, patterns in KERNEL_GROUPS if any(p in lower for p in patterns)), "other")


def kernel_summary(work: list[tuple[str, float, float]], top: int = 12) -> dict:
    """Seconds of device work summed (``device_seconds``), the time the device was busy with any of it (the union of
    the intervals, ``device_busy_seconds``: streams that overlap count once), the seconds and counts by group
    (:data:`KERNEL_GROUPS`) and the ``top`` kernels by seconds."""
    busy, reach = 0.0, None
    for _, start, end in sorted(work, key=lambda w: w[1]):
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    groups: dict[str, list[float]] = {}
    names: dict[str, list[float]] = {}
    for name, start, end in work:
        for table, key in ((groups, kernel_group(name)), (names, name[:120])):
            entry = table.setdefault(key, [0.0, 0])
            entry[0] += (end - start) / 1e6
            entry[1] += 1
    ranked = sorted(names.items(), key=lambda item: -item[1][0])[:top]
    return {"device_seconds": sum(end - start for _, start, end in work) / 1e6, "device_busy_seconds": busy / 1e6,
            "device_groups": {g: {"seconds": s, "count": int(n)} for g, (s, n) in sorted(groups.items())},
            "top_kernels": [{"name": n, "seconds": s, "count": int(c)} for n, (s, c) in ranked]}


def run_plain(name: str, args: argparse.Namespace, dtype: str, memory: DeviceMemory) -> dict:
    """Plain backprop of the whole model: k forward / backward passes, then one Adam step (fp16: through torch's
    ``GradScaler``, one scale for the model)."""
    specs, loss_fn, _, _, size = model(name, args)
    device = memory.device
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([spec.build() for spec in specs]).to(device)
    to_layout(layers, name, args)
    channels_last = channels_last_share(layers)
    optimizer = torch.optim.AdamW(layers.parameters(), **OPTIMIZER)
    data = itertools.cycle(micro_batches(name, args, size, device))
    k, narrow = args.k, AUTOCAST[dtype]
    scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None

    def layer_by_layer(x: Any) -> Any:
        for layer in layers:
            with torch.autocast(device.type, dtype=narrow or torch.bfloat16, enabled=narrow is not None):
                x = layer(x)
            if narrow is not None:  # back to fp32 streams, as at a PETRA stage boundary
                x = tuple(t.float() for t in x) if isinstance(x, tuple) else x.float()
        return x

    def train_batch() -> None:
        for _ in range(k):
            x, labels = next(data)
            loss = loss_fn(layer_by_layer(x), labels) / k
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(layers.parameters(), CLIPPING)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)

    result = timed(train_batch, 2, args.calls, memory)
    precision = dtype if scaler is None else f"{dtype} autocast, GradScaler at {scaler.get_scale():g}"
    layers = optimizer = data = None  # what train_batch held goes before the leftover is measured
    return result | {"channels_last_weights": channels_last, "precision": precision,
                     "leftover_bytes": memory.release()}


def run_petra(name: str, args: argparse.Namespace, dtype: str, memory: DeviceMemory,
              petra: dict[str, Any] | None = None) -> dict:
    """PetraEngine, all J stages in this process, with the ``"petra"`` settings ``petra``; timed after
    ceil(2(J-1)/k) + 1 calls fill the pipeline."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    import petra_ds

    petra = dict(petra or {})
    if petra.get("cuda_graphs") is True and args.device == "cpu":
        petra["cuda_graphs"] = "emulate"  # a CPU smoke run: the same code with the graphs' eager stand-ins
    specs, loss_fn, partition, J, size = model(name, args)
    module = petra_ds.PetraPipelineModule(specs, topology=PipeDataParallelTopology(num_pp=1, num_dp=1),
                                          loss_fn=loss_fn, stages_per_rank=J, partition_method=partition,
                                          base_seed=0)
    config = {"train_micro_batch_size_per_gpu": size, "gradient_accumulation_steps": args.k,
              "optimizer": {"type": "AdamW", "params": {**OPTIMIZER, "torch_adam": True}}, "steps_per_print": 10**9,
              "gradient_clipping": CLIPPING,
              "petra": {"stages_per_rank": J, **petra}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    to_layout(module, name, args)
    engine, *_ = petra_ds.initialize(model=module, config=config)
    channels_last = channels_last_share(engine.module)
    batches = micro_batches(name, args, size, engine.device)
    data = itertools.cycle(batches)
    fill = math.ceil(2 * (J - 1) / args.k) + 1
    result = timed(lambda: engine.train_batch(data), fill, args.calls, memory)
    result.update(breakdown(engine, batches, result))
    result["parts"] = [int(p) for p in module.petra_parts]
    result["reconstructing_stages"] = {j: len(st.layers) for j, st in engine.stages.items() if st.reconstructs}
    result["channels_last_weights"] = channels_last
    scales = engine.stages.loss_scales()
    result["precision"] = engine.precision.describe() + (f", at {sorted(set(scales.values()))}" if scales else "")
    result["skipped_steps"] = len(engine.skipped_steps)  # fp16: each stage's overflows while its scale comes down
    engine = module = data = None  # what train_batch held goes before the leftover is measured
    return result | {"leftover_bytes": memory.release()}


def breakdown(engine: Any, batches: list, result: dict) -> dict:
    """Where PETRA's device bytes are between calls: ``memory_report()`` by part (summed over stages), the distinct
    device storages behind them (``ledger.stage_tensors``) and the benchmark's micro-batches (what should account for
    ``memory_allocated``), and the workspace, the peak less what stays allocated."""
    from petra_ds.runtime.ledger import HOST_PARTS, stage_tensors, storage_bytes
    from petra_ds.util.nested import tensors_in

    report = engine.memory_report()
    tensors = {j: stage_tensors(engine, j) for j in engine.stages}
    parts = {part: sum(r[part] for r in report.values()) for part in [*next(iter(tensors.values())), "graph_pools"]}
    held = [batches, *([v for part, v in t.items() if part not in HOST_PARTS] for t in tensors.values())]
    on_device = [t for t in tensors_in(held) if t.device == engine.device]  # not a stray host scalar
    out: dict[str, Any] = {"memory_report": parts, "explained_bytes": storage_bytes(on_device, set())}
    if result["allocated_after_bytes"] is not None:
        out["workspace_bytes"] = result["peak_bytes"] - result["allocated_after_bytes"]
    return out


# --- the report ---

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def summarize(runs: list[dict]) -> dict:
    """Medians over rounds per (model, dtype, variant) and the ratios between variants."""
    table: dict[tuple[str, str], dict[str, dict]] = {}
    for r in runs:
        table.setdefault((r["model"], r["dtype"]), {}).setdefault(r["variant"], []).append(r)
    memory, speed = [], []
    for (name, dtype), variants in table.items():
        row_m: dict[str, Any] = {"model": name, "dtype": dtype}
        row_s: dict[str, Any] = {"model": name, "dtype": dtype}
        for variant, rs in variants.items():
            for key in ("peak_bytes", "reserved_peak_bytes"):
                peaks = [r[key] for r in rs if r.get(key) is not None]
                row_m[f"{variant}_{key}"] = max(peaks) if peaks else None
            last = rs[-1]
            for key in ("allocated_after_bytes", "explained_bytes", "workspace_bytes", "memory_report",
                        "host_peak_bytes"):
                if last.get(key) is not None:
                    row_m[f"{variant}_{key}"] = last[key]
            row_s[f"{variant}_seconds_per_call"] = statistics.median(r["median_seconds"] for r in rs)
            row_s[f"{variant}_rounds"] = [r["median_seconds"] for r in rs]
            for part in ("host", "device", "device_busy", "profiled_wall"):  # profiled: see profiled()
                if all(f"{part}_seconds" in r for r in rs):
                    row_s[f"{variant}_{part}_seconds_per_call"] = statistics.median(r[f"{part}_seconds"] for r in rs)
            for part in ("device_groups", "host_by_instruction", "host_by_op"):
                if last.get(part):
                    row_s[f"{variant}_{part}"] = last[part]
        for a, b in (("petra", "plain"), ("petra_overlap", "plain"), ("petra_overlap", "petra"),
                     ("petra", "petra_unchecked"), ("petra_offload", "plain"), ("petra_offload", "petra"),
                     ("petra_offload_messages", "plain"), ("petra_offload_messages", "petra"),
                     ("petra_offload_auto", "petra"), ("petra_compiled", "petra"), ("petra_graphs", "plain"),
                     ("petra_graphs", "petra")):
            if row_m.get(f"{a}_peak_bytes") and row_m.get(f"{b}_peak_bytes"):
                row_m[f"{a}/{b}"] = row_m[f"{a}_peak_bytes"] / row_m[f"{b}_peak_bytes"]
            if f"{a}_seconds_per_call" in row_s and f"{b}_seconds_per_call" in row_s:
                row_s[f"{a}/{b}"] = row_s[f"{a}_seconds_per_call"] / row_s[f"{b}_seconds_per_call"]
        memory.append(row_m)
        speed.append(row_s)
    return {"memory": memory, "time": speed}


def host_line(split: dict, names: int = 4) -> str:
    """:func:`host_by_op`'s split in one line: outside every event, in events on the calling thread and on the others,
    then the first ``names`` names by self time."""
    ms = {part: seconds * 1e3 for part, seconds in split["self_seconds"].items()}
    first = ", ".join(f"{entry['name']} {entry['seconds'] * 1e3:.1f} ms ({entry['count']})"
                      for entry in split["top"][:names])
    inside = split["instructions_self_seconds"] * 1e3
    return (f"{split['outside_seconds'] * 1e3:.1f} ms outside every event, {ms['caller']:.1f} ms in events "
            f"({inside:.1f} ms the instructions' own), {ms['other']:.1f} ms on other threads; by self time: {first}")


def print_report(report: dict) -> None:
    print(f"\n{report['device']}, k={report['sizes']['k']}, {report['sizes']['rounds']} round(s)")
    for row in report["time"]:
        times = ", ".join(f"{v} {row[f'{v}_seconds_per_call'] * 1e3:.1f} ms" for v in VARIANTS
                          if f"{v}_seconds_per_call" in row)
        ratios = ", ".join(f"{k} {row[k]:.3f}x" for k in row if "/" in k)
        print(f"  {row['model']:9s} {row['dtype']}: per train_batch {times}; {ratios}")
        busy = ", ".join(f"{v} {row[f'{v}_device_busy_seconds_per_call'] * 1e3:.1f} of "
                         f"{row[f'{v}_profiled_wall_seconds_per_call'] * 1e3:.1f} ms" for v in VARIANTS
                         if row.get(f"{v}_device_busy_seconds_per_call"))
        if busy:
            print(f"    device busy, profiled call: {busy}")
        for v in ("plain", "petra"):
            if row.get(f"{v}_host_by_op"):
                print(f"    host of {v}'s profiled call: {host_line(row[f'{v}_host_by_op'])}")
    measure = "max_memory_allocated" if report["device_type"] == "cuda" else "peak (allocator tracker)"
    for row in report["memory"]:
        peaks = ", ".join(f"{v} {row[f'{v}_peak_bytes'] / 2**20:.1f} MiB" for v in VARIANTS
                          if row.get(f"{v}_peak_bytes") is not None)
        ratios = ", ".join(f"{k} {row[k]:.3f}x" for k in row if "/" in k)
        print(f"  {row['model']:9s} {row['dtype']}: {measure} {peaks}; {ratios}")
        reserved = ", ".join(f"{v} {row[f'{v}_reserved_peak_bytes'] / 2**20:.1f} MiB" for v in VARIANTS
                             if row.get(f"{v}_reserved_peak_bytes") is not None)
        if reserved:  # allocated plus the allocator's cached, fragmented blocks
            print(f"    max_memory_reserved (what nvidia-smi counts): {reserved}")
        hosts = ", ".join(f"{v} {row[f'{v}_host_peak_bytes'] / 2**20:.1f} MiB" for v in VARIANTS
                          if row.get(f"{v}_host_peak_bytes"))
        if hosts:
            print(f"    host copies at their peak: {hosts}")
        for v in VARIANTS:
            if row.get(f"{v}_allocated_after_bytes") is not None and f"{v}_explained_bytes" in row:
                print(f"    {v}: between calls {row[f'{v}_allocated_after_bytes'] / 2**20:.1f} MiB allocated, "
                      f"{row[f'{v}_explained_bytes'] / 2**20:.1f} MiB named by memory_report, "
                      f"workspace {row[f'{v}_workspace_bytes'] / 2**20:.1f} MiB")
            pools = (row.get(f"{v}_memory_report") or {}).get("graph_pools")
            if pools:  # reserved by CUDA graphs' private pools, which max_memory_allocated sees only while capturing
                print(f"    {v}: its CUDA graphs' pools reserve {pools / 2**20:.1f} MiB more")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("python -m benchmarks.gpu needs a CUDA device and torch.cuda.is_available() is False; "
              "`--device cpu --tiny` smoke-runs its code paths on CPU", file=sys.stderr)
        return 2
    if args.device == "cpu":  # DeepSpeed's CPU accelerator and gloo even where a GPU is visible
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        torch.set_num_threads(1)  # a smoke run: no OpenMP spinning against whatever else runs
    import deepspeed

    import petra_ds

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    petra_ds.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    slug = re.sub(r"[^a-z0-9]+", "_", device_name(device).lower()).strip("_") if device.type == "cuda" else "cpu"
    filename = f"gpu_{slug}{'_tiny' if args.tiny else ''}.json"
    output = args.output or os.path.join(ROOT, "benchmarks", "results", filename)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    runs: list[dict] = []
    for round_ in range(args.rounds):
        for name, dtype, variant in itertools.product(args.models, args.dtypes, args.variants):
            with DeviceMemory(device) as memory:
                if variant == "plain":
                    result = run_plain(name, args, dtype, memory)
                else:
                    result = run_petra(name, args, dtype, memory, PETRA_VARIANTS[variant])
            runs.append({"model": name, "dtype": dtype, "variant": variant, "round": round_, **result})
            peak = result["peak_bytes"]
            print(f"[round {round_ + 1}/{args.rounds}] {name:9s} {dtype} {variant:22s} "
                  f"{result['median_seconds'] * 1e3:9.1f} ms/call"
                  + (f", peak {peak / 2**20:.1f} MiB" if peak is not None else ""), flush=True)
            report = {  # rewritten after every run: a run cut short by a time limit keeps what it measured
                "command": "python -m benchmarks.gpu " + " ".join(argv),
                "device": device_name(device), "device_type": device.type, "torch": torch.__version__,
                "deepspeed": deepspeed.__version__, "tiny": args.tiny, "channels_last": args.channels_last,
                "complete": False,
                "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
                "bf16_casts_shared_per_clock": shares_casts(),  # this torch's autocast cache: petra_ds/nn/casts.py
                "sizes": {key: getattr(args, key) for key in FULL},
                **summarize(runs), "runs": runs,
            }
            write_text_atomic(output, json.dumps(report, indent=1))
    report["complete"] = True
    write_text_atomic(output, json.dumps(report, indent=1))
    print_report(report)
    print(f"saved {output}")
    from petra_ds.runtime.shutdown import shutdown

    shutdown()  # the groups end here: an H100 run that left NCCL's to the interpreter's exit ran on for minutes
    return 0


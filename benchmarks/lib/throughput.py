"""Training throughput of PETRA beside plain backprop and DeepSpeed's own pipeline, in one run.

    OMP_NUM_THREADS=1 python -m benchmarks.peers --model revgpt --stages 2     # CPU, 2 processes
    OMP_NUM_THREADS=1 python -m benchmarks.peers --model revnet --stages 2
    python -m benchmarks.peers --model revgpt --stages 8 --d-model 1024        # 8 GPUs

Variants, each in fresh processes under the deepspeed launcher, same layers, micro-batch and optimizer
(torch Adam), timed after a warm-up that fills PETRA's pipeline:

    single      one process, plain backprop of the whole model, k micro-batches per optimizer step
    naive_mp    DeepSpeed's pipeline with gradient_accumulation_steps 1: stages never overlap
    1f1b        DeepSpeed's TrainSchedule over k micro-batches (every activation stored)
    1f1b_ckpt   the same with DeepSpeed's activation checkpointing of every block (PETRA's arithmetic)
    petra       petra_ds, no activation or weight buffer for reversible stages, no flush
    torch_*     torch.distributed.pipelining's Schedule1F1B, ScheduleInterleaved1F1B,
                ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV, each also with
                torch's activation checkpointing of every block (``_ckpt``); see ``torch_pipe``

Every pipelined variant uses the same partition method (``--partition``; by default as many transformer
blocks per stage for the RevGPT, DeepSpeed's ``uniform`` for the RevNet) and --stages processes; with
``profile`` each schedule is cut by its own cost rule (``petra_ds.pipeline.partition``), from one
measurement. DeepSpeed's pipeline gets the two streams stacked into one tensor (``Packed``), which halves its backward on
reversible models; ``--ds-pairs`` measures it on the plain pair.
Each rank also times its own stage's primitives (``petra_ds.perf.time_model.measure_stage_costs``)
and the message time between neighbours, for the timeline model. After the timed calls one more call
records each rank's peak memory as the allocator sees it (``peak_allocated``: every tensor storage alive,
parameters, gradients, optimizer state, activations, saved tensors, recompute graphs and messages
included, through ``petra_ds.diagnostics.allocated``; ``torch.cuda.max_memory_allocated`` on a GPU) and
what the peak is made of; and one more its peak bytes held for the backward (``peak_held_bytes``): the
most bytes autograd's saved tensors hold at once (``HeldTracker``, parameters excluded), plus for PETRA
its buffers' largest size at a clock's end. The held figure has two blind spots, both in the checkpointed
baselines' favour (the graph a checkpoint rebuilds inside the backward, DeepSpeed's checkpointed block
inputs); the allocated one has neither. Writes
``runs/benchmarks/throughput_<model>_<device>.json`` (``--output`` to choose; the committed reports in
``benchmarks/results/`` are regenerated only when named there) and prints samples/s and ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.nn import functional as F

from petra_ds.util.files import write_text_atomic

from . import torch_pipe
from .example_runs import ROOT, module_env, save_report

VARIANTS = ("single", "naive_mp", "1f1b", "1f1b_ckpt", "petra", *torch_pipe.VARIANTS)
#: the ratios the issue asks for: (numerator, denominator)
RATIOS = (("petra", "single"), ("petra", "1f1b_ckpt"), ("petra", "1f1b"), ("petra", "naive_mp"),
          *(("petra", v) for v in torch_pipe.VARIANTS),
          ("1f1b", "single"), ("1f1b_ckpt", "single"), ("naive_mp", "single"))
#: the pipeline schedules PETRA is compared with, and those that keep no block's activations
PEERS = tuple(v for v in VARIANTS if v not in ("single", "petra"))
CHECKPOINTED = tuple(v for v in PEERS if v.endswith("_ckpt"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["revgpt", "revnet"], default="revgpt")
    parser.add_argument("--stages", type=int, default=2, help="pipeline processes (J); one stage each")
    parser.add_argument("--micro-batches", type=int, default=4, help="k: micro-batches per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--partition", default=None,
                        help="partition_method for every pipelined variant (default: revgpt type:RevGPTBlock, the "
                             "same number of blocks per stage; revnet uniform); 'profile': cut by the layers' "
                             "costs, measured once by this process (petra_ds.pipeline.partition), for PETRA and "
                             "DeepSpeed alike")
    parser.add_argument("--ds-pairs", action="store_true",
                        help="give DeepSpeed's pipeline the two streams as a pair of tensors, as they are (it then "
                             "runs one backward per tensor); default: stacked into one tensor (see Packed)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--warmup", type=int, default=3, help="train_batch calls before timing (at least the fill)")
    parser.add_argument("--calls", type=int, default=6, help="timed train_batch calls (k micro-batches each)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the variants this many rounds, interleaved; the best round of each is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    # RevGPT
    parser.add_argument("--layers", type=int, default=8, help="revgpt: reversible blocks")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--grain", choices=["block", "half"], default="block",
                        help="revgpt: one layer per block, or its attention and MLP halves (a finer cut for --partition "
                             "profile)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.0, help="revgpt: dropout (throughput does not depend on it)")
    # RevNet
    parser.add_argument("--depth", type=int, default=18, choices=[18, 34, 50])
    parser.add_argument("--width", type=int, default=16, help="revnet: base width (64 is the paper's)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--no-costs", dest="costs", action="store_false",
                        help="skip timing each stage's primitives for the timeline model")
    parser.add_argument("--output", default=None, help="JSON report, relative to the repository root "
                        "(default runs/benchmarks/throughput_<model>_<device>.json)")
    parser.add_argument("--seed", type=int, default=0)
    # one variant inside the launcher
    parser.add_argument("--layer-costs", default=None, help=argparse.SUPPRESS)  # the driver's measurement
    parser.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- the model and its data ---

class Packed(torch.nn.Module):
    """A layer whose pair of streams travels as one stacked tensor (the DeepSpeed baselines only).

    DeepSpeed's pipeline runs one ``backward`` per floating output tensor of a stage, each through the
    stage's whole graph: with a reversible model's pair of streams every backward would cost twice. One
    stacked tensor gives it a single backward, for a few microseconds of ``stack`` / ``unbind``."""

    def __init__(self, spec, unpack_input: bool, pack_output: bool) -> None:
        super().__init__()
        self.layer = spec.build(log=False)
        self.unpack_input, self.pack_output = unpack_input, pack_output

    def forward(self, x):
        if self.unpack_input:
            x = tuple(x.unbind(0))
        y = self.layer(x)
        return torch.stack(y) if self.pack_output else y


class PackedBlock(Packed):
    """A reversible block (pair in, pair out): the layers DeepSpeed checkpoints and partitions by."""


def layers_and_loss(args: argparse.Namespace, packed: bool = False) -> tuple[list, object, str]:
    """(layer specs, loss_fn, the class-name pattern of the blocks): the pattern partitions the stages
    (``type:<pattern>``, same number of blocks each) and picks the layers DeepSpeed checkpoints."""
    if args.model == "revgpt":
        from petra_ds.models.transformer import RevGPTConfig, lm_loss, revgpt_layers

        config = RevGPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                              n_layers=args.layers, n_heads=args.heads, dropout=args.dropout, grain=args.grain)
        blocks = "AttentionHalf|MLPHalf" if args.grain == "half" else "RevGPTBlock"
        specs, loss_fn = revgpt_layers(config), lm_loss
    else:
        from petra_ds.models.revnet import revnet_layers

        specs = revnet_layers(args.depth, num_classes=10, cifar=True, base_width=args.width)
        loss_fn, blocks = F.cross_entropy, "RevBlock|DownsampleBlock"
    if not packed:
        return specs, loss_fn, blocks
    return pack_specs(specs, args.model), loss_fn, "PackedBlock"


def pack_specs(specs: list, model: str) -> list:
    """``specs`` (a RevGPT's or a RevNet's layers) as :class:`Packed` layers: the blocks, pair in and
    pair out, become :class:`PackedBlock`."""
    from deepspeed.runtime.pipe.module import LayerSpec

    last = len(specs) - 1  # stem: data in, pair out; blocks: pair in and out; revgpt's norm / revnet's head: pair in
    wrapped = []
    for i, spec in enumerate(specs):
        if model == "revgpt":
            pair_in, pair_out = 0 < i < last, i < last - 1
        else:
            pair_in, pair_out = i > 0, i < last
        cls = PackedBlock if pair_in and pair_out else Packed
        wrapped.append(LayerSpec(cls, spec, pair_in, pair_out))
    return wrapped


def partition(args: argparse.Namespace, blocks: str) -> str:
    return args.partition or (f"type:{blocks}" if args.model == "revgpt" else "uniform")


def measure_costs(args: argparse.Namespace, path: str) -> list:
    """``--partition profile``: every layer's costs, measured once in this (driver) process with the
    workers' thread count, saved to ``path`` for every worker to cut the same stages from."""
    from petra_ds.pipeline.partition import save_costs
    from petra_ds.tools.run_partition import measure_specs

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    specs, loss_fn, _ = layers_and_loss(args)
    cpu = torch.device("cpu")
    costs = measure_specs(specs, micro_batches(args, cpu, count=1)[0], loss_fn, cpu)
    save_costs(costs, path)
    return costs


def micro_batches(args: argparse.Namespace, device: torch.device, count: int = 8) -> list[tuple]:
    """A few fixed synthetic micro-batches (throughput does not depend on their values)."""
    g = torch.Generator().manual_seed(args.seed)
    b = args.micro_batch_size
    out = []
    for _ in range(count):
        if args.model == "revgpt":
            ids = torch.randint(args.vocab_size, (b, args.seq_len + 1), generator=g)
            out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
        else:
            x = torch.randn(b, 3, args.image_size, args.image_size, generator=g)
            out.append((x.to(device), torch.randint(10, (b,), generator=g).to(device)))
    return out


def ds_config(args: argparse.Namespace, variant: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": 1 if variant == "naive_mp" else args.micro_batches,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    if variant == "petra":
        config["petra"] = {"stages_per_rank": 1}
    return config


# --- one variant, inside the launched processes ---

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_single(args: argparse.Namespace, device: torch.device) -> dict:
    """Plain backprop of the whole model in this process: the reference every pipeline divides."""
    specs, loss_fn, _ = layers_and_loss(args)
    torch.manual_seed(args.seed)
    layers = torch.nn.ModuleList([spec.build() for spec in specs]).to(device)
    optimizer = torch.optim.Adam(layers.parameters(), lr=1e-4)
    data = itertools.cycle(micro_batches(args, device))
    k = args.micro_batches

    def train_batch() -> None:
        for _ in range(k):
            x, labels = next(data)
            for layer in layers:
                x = layer(x)
            (loss_fn(x, labels) / k).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = _time_calls(args, device, train_batch, micro_batches_per_call=k)
    result["peak_allocated"] = peak_allocated(train_batch, list(layers.parameters()), optimizer, device)
    result["peak_held_bytes"] = peak_held_bytes(train_batch, layers.parameters())
    result["host_counts"] = host_counts(train_batch)
    return result


def pipeline_module(args: argparse.Namespace, variant: str):
    """The pipeline module of ``variant``: PETRA's (``petra``) or DeepSpeed's (naive_mp, 1f1b, 1f1b_ckpt),
    each cut by its own schedule's cost with ``--partition profile``."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    import petra_ds
    from petra_ds.tools.run_partition import baseline_module

    specs, loss_fn, blocks = layers_and_loss(args, packed=variant != "petra" and not args.ds_pairs)
    method = partition(args, blocks)
    costs = {"layer_costs": args.layer_costs} if method == "profile" else {}
    if variant == "petra":
        return petra_ds.PetraPipelineModule(specs, num_stages=args.stages, loss_fn=loss_fn, stages_per_rank=1,
                                            partition_method=method, base_seed=args.seed, **costs)
    # non-reentrant: DeepSpeed's pipeline calls backward once per output tensor (a reversible stage has
    # two) and its reentrant checkpoint frees what it saved after the first
    ckpt = {"activation_checkpoint_interval": 1, "checkpointable_layers": blocks.split("|"),
            "activation_checkpoint_func": checkpointing.non_reentrant_checkpoint} if variant == "1f1b_ckpt" else {}
    rule = {"partition_rule": "backprop_ckpt" if ckpt else "backprop"} if costs else {}
    return baseline_module(specs, num_stages=args.stages, loss_fn=loss_fn, partition_method=method,
                           seed_layers=False, **ckpt, **costs, **rule)


def run_pipeline(args: argparse.Namespace, variant: str, device: torch.device) -> dict:
    """DeepSpeed's PipelineEngine (naive_mp, 1f1b, 1f1b_ckpt) or PetraEngine (petra), same layers."""
    import deepspeed
    from deepspeed import comm as dist

    import petra_ds

    module = pipeline_module(args, variant)
    if variant == "petra":
        engine, *_ = petra_ds.initialize(model=module, config=ds_config(args, variant),
                                         model_parameters=module.parameters())
    else:
        engine, *_ = deepspeed.initialize(model=module, config=ds_config(args, variant),
                                          model_parameters=module.parameters())
    data = itertools.cycle(micro_batches(args, engine.device))
    k = engine.gradient_accumulation_steps()
    result = _time_calls(args, engine.device, lambda: engine.train_batch(data), micro_batches_per_call=k,
                         barrier=dist.barrier)
    result["parts"] = [int(p) for p in getattr(module, "petra_parts", module.parts)]
    result["peak_allocated"] = peak_allocated(lambda: engine.train_batch(data), list(module.parameters()),
                                              engine.optimizer, engine.device)
    buffers = petra_buffer_peak(engine, module.parameters()) if variant == "petra" else None
    result["peak_held_bytes"] = peak_held_bytes(lambda: engine.train_batch(data), module.parameters(), buffers)
    result["host_counts"] = host_counts(lambda: engine.train_batch(data))
    if variant == "petra" and args.costs:
        result["costs"] = stage_costs(engine, data)
    return result


def torch_peer(args: argparse.Namespace, variant: str, device: torch.device) -> torch_pipe.Peer:
    """This rank's part of torch pipelining's ``variant`` on the same (stacked-stream) layers."""
    specs, loss_fn, blocks = layers_and_loss(args, packed=True)
    costs = None
    if partition(args, blocks) == "profile":
        from petra_ds.pipeline.partition import load_costs

        costs = load_costs(args.layer_costs)
    return torch_pipe.build(variant, specs, loss_fn, args.micro_batches, device, costs=costs,
                            method=partition(args, blocks), block_pattern=blocks, seed=args.seed)


def run_torch(args: argparse.Namespace, variant: str, device: torch.device) -> dict:
    """One of torch.distributed.pipelining's schedules, timed."""
    from torch import distributed as dist

    peer = torch_peer(args, variant, device)
    optimizer = torch.optim.Adam(peer.parameters(), lr=1e-4)
    k = args.micro_batches
    data = micro_batches(args, device, count=max(8, k))  # at least one whole batch of k
    batches = itertools.cycle([tuple(torch.cat(part) for part in zip(*data[i:i + k]))
                               for i in range(0, len(data) - k + 1, k)])

    def train_batch() -> None:
        peer.step(optimizer, *next(batches))

    result = _time_calls(args, device, train_batch, micro_batches_per_call=k, barrier=dist.barrier)
    result["parts"] = peer.parts
    result["peak_allocated"] = peak_allocated(train_batch, list(peer.parameters()), optimizer, device)
    result["peak_held_bytes"] = peak_held_bytes(train_batch, peer.parameters())
    result["host_counts"] = host_counts(train_batch)
    return result


def host_counts(train_batch) -> list[dict]:
    """Every rank's host work in one more call, counted: the Python bytecodes it interprets and the aten ops it
    dispatches (``petra_ds.diagnostics.host_cost``). Unlike the time a call takes on a shared machine, a count does
    not move with the load, and a host-bound GPU pays for both."""
    from torch import distributed as dist

    from petra_ds.diagnostics.host_cost import Bytecodes, OpCounter

    with OpCounter() as ops:
        train_batch()
    with Bytecodes() as bytecodes:
        train_batch()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"bytecodes": bytecodes.total, "ops": ops.total})
    return gathered


def host_count_ratios(variants: dict) -> dict[str, dict[str, float]]:
    """PETRA's busiest rank over each peer's, in bytecodes and in ops per call (:func:`host_counts`): with one
    stage a rank and k micro-batches a call, PETRA's host work per stage-clock over the peer's per micro-batch per
    stage. Empty without PETRA's counts; the one-process variant is no peer."""
    if "host_counts" not in variants.get("petra", {}):
        return {}

    def busiest(v: str, count: str) -> int:
        return max(rank[count] for rank in variants[v]["host_counts"])

    return {f"petra/{v}": {count: busiest("petra", count) / busiest(v, count) for count in ("bytecodes", "ops")}
            for v in variants if v in PEERS and "host_counts" in variants[v]}


def peak_allocated(train_batch, params: list, optimizer, device: torch.device) -> list[dict]:
    """Every rank's peak memory during one more call, as the allocator sees it, and what it is made of
    (parameters, gradients, optimizer state, the rest: activations, saved tensors, messages)."""
    from torch import distributed as dist

    from petra_ds.diagnostics.allocated import AllocatedStorages

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_batch()
        torch.cuda.synchronize(device)
        mine = {"peak": int(torch.cuda.max_memory_allocated(device)), "source": "torch.cuda.max_memory_allocated"}
    else:
        with AllocatedStorages(AllocatedStorages.training_parts(params, optimizer)) as counter:
            train_batch()
        mine = {"peak": counter.peak_bytes, "parts": counter.peak_parts, "source": "AllocatedStorages"}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def peak_held_bytes(train_batch, params, buffers=None) -> list[int]:
    """Every rank's peak bytes held for the backward during one more call: the most bytes autograd's saved
    tensors hold at once, plus (``buffers``, PETRA) the largest its buffers reach at a clock's end."""
    from torch import distributed as dist

    from petra_ds.diagnostics.held import HeldTracker

    tracker = HeldTracker(exclude=list(params))
    with tracker.recording():
        train_batch()
    mine = tracker.peak_bytes + (buffers.stop() if buffers is not None else 0)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [int(b) for b in gathered]


def petra_buffer_peak(engine, params):
    """An observer of PETRA's buffers (input FIFO, raw micro-batches, messages): the most bytes they
    hold at a clock's end; ``stop()`` detaches it and returns that maximum."""
    from petra_ds.diagnostics.held import BUFFER_CATEGORIES, HeldTracker, petra_buffers
    from petra_ds.runtime.observe import Observer

    exclude = list(params)

    class BufferPeak(Observer):
        most = 0

        def clock_end(self, engine, clock):
            for stage in engine.local_stage_ids:
                held = HeldTracker().measure(petra_buffers(engine, stage), exclude=exclude)
                self.most = max(self.most, sum(held[c] for c in BUFFER_CATEGORIES))

        def stop(self) -> int:
            engine.unobserve(self)
            return self.most

    return engine.observe(BufferPeak())


def _time_calls(args: argparse.Namespace, device: torch.device, train_batch, micro_batches_per_call: int,
                barrier=None) -> dict:
    """Warm up, then time calls covering ``args.calls`` x k micro-batches (naive_mp takes one per call,
    so it makes k times as many calls)."""
    scale = args.micro_batches // micro_batches_per_call
    samples_per_call = micro_batches_per_call * args.micro_batch_size
    for _ in range(args.warmup * scale):
        train_batch()
    _sync(device)
    if barrier is not None:
        barrier()
    times = []
    start = time.perf_counter()
    for _ in range(args.calls * scale):
        t0 = time.perf_counter()
        train_batch()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if barrier is not None:
        barrier()
    elapsed = time.perf_counter() - start
    samples = args.calls * scale * samples_per_call
    return {"samples_per_s": samples / elapsed, "seconds": elapsed, "samples": samples,
            "seconds_per_call": times}


def stage_costs(engine, data) -> dict:
    """This rank's stage primitives (on an input it really received) and the neighbour message time,
    gathered on every rank."""
    from deepspeed import comm as dist

    from petra_ds.perf.time_model import measure_stage_costs

    from petra_ds.runtime.observe import Observer

    (stage_id,) = engine.local_stage_ids
    stage = engine.stages[stage_id]

    class Inputs(Observer):
        seen: list = []

        def after_forward(self, engine, stage, micro_batch, x, labels):
            self.seen.append((x, labels))

    inputs = engine.observe(Inputs())
    engine.train_batch(data)
    engine.unobserve(inputs)
    x, labels = inputs.seen[0]
    costs = measure_stage_costs(stage.run, x, [p for p in stage.params if p.requires_grad],
                                loss_fn=stage.loss_fn if stage.is_last else None, labels=labels,
                                optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4), input_grad=stage_id > 0)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, costs)
    return {"stages": gathered, "message_s": message_seconds(engine)}


def message_seconds(engine) -> float:
    """One stage-0 activation between pipeline ranks 0 and 1 (half a round trip, median), the same
    value on every rank."""
    from deepspeed import comm as dist

    from petra_ds.schedule import channels
    from petra_ds.runtime import messages
    from petra_ds.perf.time_model import measure_message_seconds

    if engine.num_stages < 2:
        return 0.0
    stage_rank = engine.transport.stage_rank
    holder = [engine.transport.layouts.get(channels.forward_channel(0))]  # negotiated by stage 0 on its first send
    dist.broadcast_object_list(holder, src=stage_rank(0))
    rank0, rank1 = stage_rank(0), stage_rank(1)
    median = [0.0]
    if engine.global_rank in (rank0, rank1):
        tensors = messages.allocate(holder[0], engine.device)
        peer = rank1 if engine.global_rank == rank0 else rank0
        median = [measure_message_seconds(tensors, peer, first=engine.global_rank == rank0)]
    dist.broadcast_object_list(median, src=rank0)
    return float(median[0])


def worker(args: argparse.Namespace) -> None:
    from deepspeed.accelerator import get_accelerator

    import petra_ds
    from petra_ds.runtime.shutdown import shutdown

    torch.set_num_threads(args.threads)
    petra_ds.init_distributed()
    device = torch.device(get_accelerator().device_name(), int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cpu":
        device = torch.device("cpu")
    if args.worker == "single":
        result = run_single(args, device)
    elif args.worker in torch_pipe.VARIANTS:
        result = run_torch(args, args.worker, device)
    else:
        result = run_pipeline(args, args.worker, device)
    if int(os.environ.get("RANK", 0)) == 0:
        write_text_atomic(args.result, json.dumps(result))
    shutdown()  # the engine went with run_*'s frame: every group ends here, not in the interpreter's teardown


# --- the driver ---

def launch(args: argparse.Namespace, variant: str, argv: list[str]) -> dict:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        run_launched(__spec__.name, 1 if variant == "single" else args.stages,
                     [*argv, "--worker", variant, "--result", result], env)
        with open(result) as f:
            return json.load(f)


def report_of(argv: list[str]) -> dict:
    """The report of ``main(argv)``, written to a temporary file and read back (``argv`` names no
    ``--output``): for the benchmarks that drive this one."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        main([*argv, "--output", out])
        with open(out) as f:
            return json.load(f)


def run_launched(module: str, procs: int, argv: list[str], env: dict) -> None:
    """``python -m module argv`` on ``procs`` processes under the deepspeed launcher, from the repository root
    (and with it on PYTHONPATH, so that ``benchmarks`` imports)."""
    from petra_ds.runtime.distributed import free_port

    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [deepspeed, "--num_gpus", str(procs), "--master_port", str(free_port()), "--module", module, *argv]
    subprocess.run(cmd, cwd=ROOT, check=True, env=module_env(env), stdout=subprocess.DEVNULL)


def versus_fastest_peers(variants: dict) -> dict:
    """PETRA against the fastest pipeline schedule measured (by median samples/s), of all and of the
    checkpointed ones (those that keep no block's activations, as PETRA; the peak held bytes cannot
    pick them: DeepSpeed's checkpoint keeps its block inputs outside autograd's saved tensors, where
    the hooks do not see them)."""
    groups = {"overall": [v for v in PEERS if v in variants],
              "checkpointed": [v for v in CHECKPOINTED if v in variants]}
    out = {}
    for group, names in groups.items():
        if not names:
            out[group] = None
            continue
        peer = max(names, key=lambda v: variants[v]["median_samples_per_s"])
        out[group] = {"peer": peer,
                      "median_ratio": variants["petra"]["median_samples_per_s"] / variants[peer]["median_samples_per_s"],
                      "best_ratio": variants["petra"]["samples_per_s"] / variants[peer]["samples_per_s"]}
    return out


def predicted_ratios(report: dict) -> dict[str, float]:
    """PETRA's samples/s over each peer's as the timeline model predicts them from the run's own stage costs
    (``petra_ds.perf.predict.validate``): what the arithmetic allows, beside what was measured. Empty without
    costs (``--no-costs``) or without PETRA; a peer the model does not time is left out."""
    if "costs" not in report or "petra" not in report["variants"]:
        return {}
    from petra_ds.perf.predict import validate

    predicted = {v: r["predicted_samples_per_s"] for v, r in validate(report)["variants"].items()}
    if "petra" not in predicted:
        return {}
    return {f"petra/{v}": predicted["petra"] / rate for v, rate in predicted.items() if v != "petra"}


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return f"CPU {model}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    layer_costs = None
    if args.partition == "profile":
        costs_path = os.path.join(tempfile.mkdtemp(), "layer_costs.json")
        layer_costs = measure_costs(args, costs_path)
        argv = [*argv, "--layer-costs", costs_path]
    for round_ in range(args.repeats):
        for variant in args.variants:
            result = launch(args, variant, argv)
            runs[variant].append(result)
            print(f"[round {round_ + 1}/{args.repeats}] {variant:10s} {result['samples_per_s']:8.2f} samples/s",
                  flush=True)
    # contention on a shared machine only slows a round down: the best round of each variant is its
    # speed; the median over rounds is kept beside it
    variants = {v: max(rs, key=lambda r: r["samples_per_s"]) for v, rs in runs.items()}
    for v, rs in runs.items():
        variants[v]["rounds_samples_per_s"] = [r["samples_per_s"] for r in rs]
        variants[v]["median_samples_per_s"] = statistics.median(variants[v]["rounds_samples_per_s"])
    ratios = {f"{a}/{b}": variants[a]["samples_per_s"] / variants[b]["samples_per_s"]
              for a, b in RATIOS if a in variants and b in variants}
    median_ratios = {f"{a}/{b}": variants[a]["median_samples_per_s"] / variants[b]["median_samples_per_s"]
                     for a, b in RATIOS if a in variants and b in variants}
    report = {
        "command": "python -m benchmarks.peers " + " ".join(argv),
        "device": device_name(), "torch": torch.__version__, "threads_per_process": args.threads,
        "model": args.model, "stages": args.stages, "micro_batches": args.micro_batches,
        "micro_batch_size": args.micro_batch_size, "ds_streams": "pair" if args.ds_pairs else "stacked",
        "model_args": {k: getattr(args, k) for k in ("layers", "d_model", "heads", "seq_len", "vocab_size", "grain")}
        if args.model == "revgpt" else {k: getattr(args, k) for k in ("depth", "width", "image_size")},
        "variants": variants, "ratios": ratios, "median_ratios": median_ratios,
    }
    if "petra" in variants:
        report["petra_vs_fastest_peer"] = versus_fastest_peers(variants)
    if "petra" in variants and "costs" in variants["petra"]:
        report["costs"] = variants["petra"]["costs"]
    if layer_costs is not None:
        report["layer_costs"] = [dataclasses.asdict(c) for c in layer_costs]
        if "petra" in variants:  # how far PETRA's best whole-layer cut is from equal stages
            from petra_ds.pipeline.partition import imbalance

            report["petra_imbalance"] = imbalance(layer_costs, variants["petra"]["parts"])
    predicted = predicted_ratios(report)
    if predicted:
        report["predicted_ratios"] = predicted
    counted = host_count_ratios(variants)
    if counted:
        report["host_count_ratios"] = counted
    print(f"\n{args.model}, J={args.stages}, k={args.micro_batches}, micro-batch {args.micro_batch_size}, "
          f"{report['device']}")
    for v in variants:
        print(f"  {v:10s} {variants[v]['samples_per_s']:8.2f} samples/s (best round), "
              f"{variants[v]['median_samples_per_s']:8.2f} (median)")
    for name, value in ratios.items():
        modelled = f", {predicted[name]:6.3f}x (the timeline model)" if name in predicted else ""
        print(f"  {name:28s} {value:6.3f}x (best), {median_ratios[name]:6.3f}x (median){modelled}")
    for name, value in counted.items():
        print(f"  {name:28s} host work of the busiest rank per call: {value['bytecodes']:.3f}x the bytecodes, "
              f"{value['ops']:.3f}x the ops")
    if "petra_imbalance" in report:
        print(f"  PETRA's cut {variants['petra']['parts']}: slowest stage {100 * report['petra_imbalance']:.1f}% above "
              "the mean stage (layer costs)")
    for v in variants:
        allocated = variants[v].get("peak_allocated")
        if allocated:
            peaks = ", ".join(f"{r['peak'] / 2**20:.1f}" for r in allocated)
            print(f"  {v:24s} peak allocated per rank (MiB): {peaks}")
        held = variants[v].get("peak_held_bytes")
        if held:
            print(f"  {v:24s} peak held per stage (MiB): {', '.join(f'{b / 2**20:.1f}' for b in held)}")
    for group, entry in report.get("petra_vs_fastest_peer", {}).items():
        if entry:
            print(f"  PETRA / fastest {group} peer ({entry['peer']}): {entry['median_ratio']:.3f}x (medians)")
    tag = "gpu" if torch.cuda.is_available() else "cpu"
    output = args.output or os.path.join("runs", "benchmarks",
                                         f"throughput_{args.model}_{tag}{'_dspairs' if args.ds_pairs else ''}.json")
    save_report(output, report)
    print(f"saved {output}")


if __name__ == "__main__":  # the processes run_launched starts (python -m benchmarks.lib.throughput --worker ...)
    main()

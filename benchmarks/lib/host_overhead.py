"""What a PETRA clock costs the host, measured without a GPU: aten ops per micro-batch, host syncs per
``train_batch``, and host time per clock on layers of negligible cost, against the schedules a user could pick.

    python -m benchmarks.host_overhead             # everything below, CPU, one process (about 2 min)
    python -m benchmarks.host_overhead --tiny      # the same on small sizes (what the tests check)
    python -m benchmarks.host_overhead --parts ops syncs

One process hosts all J stages (the paper's single-device setting, the same engine as on J ranks):

- ``ops``: aten ops dispatched per micro-batch at steady state (``petra_ds.diagnostics.host_cost.OpCounter``),
  PETRA against plain forward + backward of the same layers with the same optimizer (torch's fused AdamW,
  the step's ops shared over its k micro-batches), fp32 and bf16 (plain: each layer under autocast, its
  output back to fp32, as at a PETRA stage boundary; ``--dtypes`` adds fp16: plain through torch's ``GradScaler``,
  PETRA with its loss scale per stage), with ``check_finite`` on and off; per stage too,
  first / FIFO (non-reversible middle) / reconstructing / last, against the plain forward + backward of that
  stage's layers. The models have the depth, stages, heads, k and optimizer of ``python -m benchmarks.gpu`` (RevGPT:
  12 blocks, J = 4; RevNet18: J = 10), narrowed in width, sequence and batch, which change no count
  (``tests/test_host_overhead.py`` checks that). On a GPU each op is at least one kernel launch; a multi-tensor op
  more where its list mixes dtypes or layouts (CUDA then goes tensor by tensor): ``petra_foreach_dragged`` counts
  the tensors per micro-batch that would go one by one for that reason alone.
  With ``"cuda_graphs"`` (``ops_graphs``, the eager stand-ins of ``"emulate"``): each part's replay counted as the
  one launch a CUDA graph's replay is, beside the ops it holds: what a graphed clock launches.
- ``syncs``: host reads of device values inside one steady-state ``train_batch`` (``HostSyncs``), with
  the line that made each.
- ``bytecodes``: Python bytecodes interpreted per steady-state ``train_batch`` (``Bytecodes``), fp32, at the
  ``ops`` sizes: PETRA with ``check_finite`` on and off, its work without the engine (``petra_structure``, below),
  plain backprop and DeepSpeed's one-stage engine; PETRA's by package. The interpreted glue around the ops, which
  a GPU that waits for its host pays for as it pays for the ops.
- ``offload``: what ``"fifo_offload": "cpu"`` and, with it, ``"message_offload": "cpu"`` add to a steady-state
  ``train_batch`` at the ``ops`` sizes, fp32: aten ops (by op) and Python bytecodes per call against PETRA without
  them. On a GPU the copies run on side streams; what the host pays to start them and to rebuild what they copied
  is this, and a host-bound clock pays it in time.
- ``time``: host seconds per ``train_batch`` of a RevGPT with negligible compute (d 8, seq 4; ``--time-model
  revnet18``: RevNet18 at the ``ops`` sizes, J = 10 one-layer stages, the GPU benchmark's cut), medians over
  interleaved rounds: PETRA (J stages), DeepSpeed's ``PipelineEngine`` with one stage, torch's
  ``Schedule1F1B`` with one stage, plain backprop, and plain backprop plus the graph-free forward PETRA runs
  before its reconstruction (PETRA's arithmetic without its machinery: the floor of its host time), all with the
  same layers, micro-batches and optimizer;
  PETRA's host microseconds per stage-clock (time / (k J)) beside DeepSpeed's per micro-batch per stage.
- ``instructions`` (not run by default: it needs valgrind, and minutes): the same variants' host instructions per
  ``train_batch``, counted by callgrind (``.host_instructions``), medians over ``--instruction-rounds``: the
  ratios of ``time`` without the machine's noise; and their misses in a simulated 1 MiB last-level cache. With
  ``time`` in the same run, ``cost_fit`` fits the times as a price per instruction plus one per miss.

Writes ``benchmarks/results/host_overhead_cpu.json`` (``--output`` to choose) and prints a summary.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch

from petra_ds.util.files import write_text_atomic

from . import host_instructions
from .example_runs import one_cpu_process, save_report
from .single_gpu import AUTOCAST, DEFAULT_DTYPES, DTYPES

PARTS = ("ops", "syncs", "bytecodes", "offload", "time", "instructions")
#: what a run without --parts measures (instructions need valgrind and minutes)
DEFAULT_PARTS = ("ops", "syncs", "bytecodes", "offload", "time")
MODELS = ("revgpt", "revnet18")
#: what changes an op count is kept from the GPU benchmark (blocks, stages, heads, k); the rest is narrowed
FULL = {"k": 4, "revgpt_blocks": 12, "revgpt_heads": 12, "revgpt_d": 96, "revgpt_seq": 16, "revgpt_batch": 2,
        "revgpt_stages": 4, "revnet_width": 8, "revnet_image": 8, "revnet_batch": 2, "revnet_stages": 10,
        "time_blocks": 8, "time_stages": 4, "rounds": 30, "calls": 3}
TINY = {"k": 4, "revgpt_blocks": 4, "revgpt_heads": 2, "revgpt_d": 16, "revgpt_seq": 8, "revgpt_batch": 2,
        "revgpt_stages": 3, "revnet_width": 4, "revnet_image": 8, "revnet_batch": 2, "revnet_stages": 10,
        "time_blocks": 4, "time_stages": 2, "rounds": 2, "calls": 4}


def parse_args(argv: list[str]) -> argparse.Namespace:
    tiny = "--tiny" in argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small sizes (what the tests check)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS))
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DEFAULT_DTYPES),
                        help="ops, ops_graphs and syncs: the precisions counted (the GPU benchmark's; fp16 opt-in)")
    parser.add_argument("--time-model", choices=MODELS, default="revgpt",
                        help="time and instructions: the negligible RevGPT (default), or RevNet18 at the ops sizes "
                             "with its J = 10 one-layer stages (the GPU benchmark's partition)")
    for name, value in (TINY if tiny else FULL).items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=value)
    parser.add_argument("--instruction-rounds", type=int, default=3,
                        help="instructions: rounds of one window per variant (each window --calls calls)")
    parser.add_argument("--output", default=None)
    parser.add_argument("--windows-to", default=None, help=argparse.SUPPRESS)  # set by the run under callgrind
    return parser.parse_args(argv)


# --- models ---

def model(name: str, args: argparse.Namespace, *, d: int | None = None, seq: int | None = None,
          blocks: int | None = None, stages: int | None = None, heads: int | None = None) -> dict[str, Any]:
    """Layer specs, loss, partition method, J, micro-batch size and a micro-batch maker for ``name``."""
    from torch.nn import functional as F

    if name == "revnet18":
        from petra_ds.models.revnet import revnet_layers

        size, image = args.revnet_batch, args.revnet_image

        def batch(g: torch.Generator) -> tuple:
            return torch.randn(size, 3, image, image, generator=g), torch.randint(10, (size,), generator=g)

        return {"specs": revnet_layers(18, num_classes=10, cifar=True, base_width=args.revnet_width),
                "loss": F.cross_entropy, "partition": "uniform", "J": stages or args.revnet_stages,
                "size": size, "batch": batch}
    from petra_ds.models.transformer import RevGPTConfig, lm_loss, revgpt_layers

    config = RevGPTConfig(vocab_size=64, seq_len=seq or args.revgpt_seq, d_model=d or args.revgpt_d,
                          n_layers=blocks or args.revgpt_blocks, n_heads=heads or args.revgpt_heads, dropout=0.0)
    size = args.revgpt_batch

    def batch(g: torch.Generator) -> tuple:
        ids = torch.randint(config.vocab_size, (size, config.seq_len + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]

    return {"specs": revgpt_layers(config), "loss": lm_loss, "partition": "type:RevGPTBlock",
            "J": stages or args.revgpt_stages, "size": size, "batch": batch}


def data(m: dict, count: int = 4) -> itertools.cycle:
    g = torch.Generator().manual_seed(0)
    return itertools.cycle([m["batch"](g) for _ in range(count)])


OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True, "fused": True}}
#: every variant clips its gradients (PETRA: each stage its own) to this norm
CLIPPING = 1.0


def torch_optimizer(params) -> torch.optim.Optimizer:
    """The optimizer of every variant: what ``OPTIMIZER`` builds in DeepSpeed (torch's fused AdamW)."""
    options = {k: v for k, v in OPTIMIZER["params"].items() if k != "torch_adam"}
    return torch.optim.AdamW(params, **options)


def petra_module(m: dict, pipe: int = 1):
    """``m``'s layers cut into its J stages over ``pipe`` pipeline ranks."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    import petra_ds

    return petra_ds.PetraPipelineModule(m["specs"], topology=PipeDataParallelTopology(num_pp=pipe, num_dp=1),
                                        loss_fn=m["loss"], stages_per_rank=m["J"] // pipe,
                                        partition_method=m["partition"], base_seed=0)


def petra_engine(m: dict, k: int, dtype: str = "fp32", petra: dict | None = None, pipe: int = 1):
    """PETRA on ``m``'s J stages over ``pipe`` pipeline ranks (1: all of them in this process), in ``dtype``
    (``DTYPES``)."""
    import petra_ds

    per_rank = m["J"] // pipe
    module = petra_module(m, pipe)
    config = {"train_micro_batch_size_per_gpu": m["size"], "gradient_accumulation_steps": k,
              "optimizer": OPTIMIZER, "steps_per_print": 10**9, "gradient_clipping": CLIPPING,
              "petra": {"stages_per_rank": per_rank, **(petra or {})}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    engine, *_ = petra_ds.initialize(model=module, config=config)
    return engine


def fill_calls(J: int, k: int) -> int:
    """``train_batch`` calls after which every clock of a call is a steady-state clock, plus one."""
    return math.ceil(2 * (J - 1) / k) + 1


def plain_model(m: dict, dtype: str) -> tuple[torch.nn.ModuleList, Callable]:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([spec.build(log=False) for spec in m["specs"]])
    autocast = AUTOCAST[dtype]

    def run(x: Any, chosen: Any = None) -> Any:
        for layer in (layers if chosen is None else chosen):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                x = layer(x)
            if autocast is not None:  # back to fp32 streams, as at a PETRA stage boundary
                x = tuple(t.float() for t in x) if isinstance(x, tuple) else x.float()
        return x

    return layers, run


class PlainStep:
    """Plain backprop's loss and step: clipping and the optimizer, and under fp16 torch's ``GradScaler`` (the loss
    scaled, the gradients unscaled before clipping, the scale updated after the step)."""

    def __init__(self, params: Any, dtype: str) -> None:
        self.params = list(params)
        self.optimizer = torch_optimizer(self.params)
        self.scaler = torch.amp.GradScaler("cpu") if dtype == "fp16" else None
        if self.scaler is not None:  # makes its scale: a stage but the last scales no loss, its gradient comes scaled
            self.scaler.scale(torch.zeros(()))

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def __call__(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.params, CLIPPING)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


# --- ops ---

def count_ops(name: str, args: argparse.Namespace, dtype: str, check_finite: bool = True, plain: bool = True,
              graphs: bool = False, **sizes: int) -> dict:
    """Ops per micro-batch: PETRA's total and per stage, plain's total and per stage (``plain=False``: PETRA's
    alone). ``graphs``: PETRA with ``"cuda_graphs": "emulate"``, each replay one op, as the launch it is on CUDA."""
    from petra_ds.diagnostics.host_cost import InstructionScopes, OpCounter

    m, k = model(name, args, **sizes), args.k
    engine = petra_engine(m, k, dtype, {"check_finite": check_finite, "cuda_graphs": "emulate" if graphs else False})
    stream = data(m)
    for _ in range(fill_calls(m["J"], k)):
        engine.train_batch(stream)
    counter = OpCounter()
    scopes = engine.observe(InstructionScopes(counter))
    replays_before = _replays(engine)
    with counter:
        engine.train_batch(stream)
    engine.unobserve(scopes)
    replayed = _replays(engine) - replays_before
    per_stage: dict[int, float] = {j: 0.0 for j in range(m["J"])}
    for scope, total in counter.scope_totals().items():
        if scope is not None and scope[0] is not None:
            per_stage[scope[0]] += total / k
    kinds = {j: stage_kind(st) for j, st in engine.stages.items()}
    parts = [int(p) for p in engine.module.petra_parts]
    dragged = sum(counter.dragged.values()) / k
    if not plain:
        return {"model": name, "dtype": dtype, "check_finite": check_finite, "J": m["J"], "k": k,
                "petra_ops": counter.total / k, "petra_foreach_dragged": dragged, "parts": parts,
                "graph_replays": counter.by_name["graph_replay"] / k,
                "in_graphs_ops": sum(counter.in_graphs.values()) / k, "parts_replayed": replayed / k}
    plain_total, plain_stages = count_plain(m, k, dtype, parts)
    return {"model": name, "dtype": dtype, "check_finite": check_finite, "J": m["J"], "k": k,
            "petra_ops": counter.total / k, "petra_foreach_dragged": dragged, "plain_ops": plain_total,
            "ratio": counter.total / k / plain_total,
            "engine_ops": counter.scope_totals().get(None, 0) / k, "parts": parts,
            "layers": [getattr(spec, "typename", type(spec)).__name__ for spec in m["specs"]],
            "stages": [{"stage": j, "kind": kinds[j], "petra_ops": per_stage[j], "plain_ops": plain_stages[j],
                        "ratio": per_stage[j] / plain_stages[j]} for j in range(m["J"])],
            "petra_by_op": {op: n / k for op, n in counter.by_name.most_common()}}


def _replays(engine: Any) -> int:
    """The graphs the engine's graphed parts have replayed so far (``cuda_graphs``)."""
    return sum(part.replays for stage in engine.stages.values() for part in stage.graphed)


def stage_kind(stage: Any) -> str:
    if stage.is_first:
        return "first"
    if stage.is_last:
        return "last"
    return "reconstructing" if stage.reconstructs else "fifo"


def count_plain(m: dict, k: int, dtype: str, parts: list[int]) -> tuple[float, list[float]]:
    """Plain backprop's ops per micro-batch: the whole model (k forward + backward, clipping and one optimizer
    step, shared over k), and per stage of ``parts`` (the stage's layers alone: forward and backward from a
    detached input, and the stage's share of the step)."""
    from petra_ds.diagnostics.host_cost import OpCounter

    whole = count_plain_by_op(m, k, dtype)
    layers, run = plain_model(m, dtype)
    stream = data(m)
    stages = []
    x, labels = next(stream)
    for j in range(len(parts) - 1):
        chosen = layers[parts[j]:parts[j + 1]]
        stage_step = PlainStep(chosen.parameters(), dtype)
        leaf = _leaf(x)
        with OpCounter() as counter:
            out = run(leaf, chosen)
            if j == len(parts) - 2:
                stage_step.loss(m["loss"](out, labels) / k).backward()
            else:
                torch.autograd.backward(list(_tuple(out)), [torch.ones_like(t) for t in _tuple(out)])
        stage_step()  # the step's first call creates its state: count the second
        stage_step.zero_grad()
        for p in chosen.parameters():
            p.grad = torch.zeros_like(p)
        with OpCounter() as step:
            stage_step()
        stage_step.zero_grad()
        stages.append(counter.total + step.total / k)
        with torch.no_grad():
            x = run(x, chosen)
    return sum(whole.values()), stages


def count_plain_by_op(m: dict, k: int, dtype: str) -> dict[str, float]:
    """Plain backprop's ops per micro-batch by name: k forward + backward passes, clipping and one optimizer
    step (shared over the k), at the second call."""
    from petra_ds.diagnostics.host_cost import OpCounter

    train_batch = _plain_call(m, k, dtype)
    train_batch()
    with OpCounter() as counter:
        train_batch()
    return {op: n / k for op, n in counter.by_name.most_common()}


def _tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _leaf(x: Any) -> Any:
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in _tuple(x)]
    return tuple(leaves) if isinstance(x, (tuple, list)) else leaves[0]


# --- syncs ---

def count_syncs(name: str, args: argparse.Namespace, dtype: str) -> dict:
    """Host reads inside one steady-state ``train_batch`` (the returned loss is not read)."""
    from petra_ds.util.host_reads import HostSyncs

    m, k = model(name, args), args.k
    engine = petra_engine(m, k, dtype)
    stream = data(m)
    for _ in range(fill_calls(m["J"], k)):
        engine.train_batch(stream)
    with HostSyncs() as syncs:
        engine.train_batch(stream)
    return {"model": name, "dtype": dtype, "syncs": syncs.count, "where": dict(syncs.where)}


# --- bytecodes ---

#: the variants of the ``bytecodes`` part
BYTECODE_VARIANTS = ("petra", "petra_unchecked", "petra_structure", "plain", "deepspeed_1f1b_one_stage")


def count_bytecodes(name: str, args: argparse.Namespace, variants: tuple[str, ...] = BYTECODE_VARIANTS) -> dict:
    """Python bytecodes per steady-state ``train_batch`` of each of ``variants``, fp32; by package. The ratios need
    the default variants."""
    from petra_ds.diagnostics.host_cost import Bytecodes

    m, k = model(name, args), args.k
    # a seed of its own for each engine: the hashes of its keys, remembered by the process, are not another's
    builders = {"petra": lambda: _petra_call(m, k, seed=1001),
                "petra_unchecked": lambda: _petra_call(m, k, check_finite=False, seed=1002),
                "petra_structure": lambda: structure_call(m, k), "plain": lambda: _plain_call(m, k),
                "deepspeed_1f1b_one_stage": lambda: _deepspeed_call(m, k)}
    per_call, areas = {}, {}
    for variant in variants:
        build = builders[variant]
        call = build()
        for _ in range(fill_calls(m["J"], k) + 1):
            call()
        with Bytecodes() as counter:
            call()
        per_call[variant] = counter.total
        areas[variant] = dict(counter.by_area.most_common())
    if variants != BYTECODE_VARIANTS:
        return {"model": name, "J": m["J"], "k": k, "per_call": per_call, "by_area": areas}
    return {"model": name, "J": m["J"], "k": k, "per_call": per_call,
            "petra/plain": per_call["petra"] / per_call["plain"],
            "petra/deepspeed": per_call["petra"] / per_call["deepspeed_1f1b_one_stage"],
            "petra/structure": per_call["petra"] / per_call["petra_structure"], "by_area": areas}


# --- what the offloads cost the host ---

#: the variants of the ``offload`` part: PETRA's ``"petra"`` settings
OFFLOADS = {"petra": {}, "fifo_offload": {"fifo_offload": "cpu"},
            "fifo_and_message_offload": {"fifo_offload": "cpu", "message_offload": "cpu"}}


def count_offload(name: str, args: argparse.Namespace) -> dict:
    """Aten ops and Python bytecodes per steady-state ``train_batch``, fp32, of PETRA with each of :data:`OFFLOADS`;
    for each offload, the ops it adds by op."""
    from petra_ds.diagnostics.host_cost import Bytecodes, OpCounter

    m, k = model(name, args), args.k
    ops, bytecodes, by_op = {}, {}, {}
    for seed, (variant, petra) in enumerate(OFFLOADS.items(), start=2001):  # a seed per engine, as in bytecodes
        call = _petra_call(m, k, seed=seed, **petra)
        for _ in range(fill_calls(m["J"], k) + 1):
            call()
        with OpCounter() as counter:
            call()
        with Bytecodes() as interpreted:
            call()
        ops[variant], bytecodes[variant], by_op[variant] = counter.total, interpreted.total, counter.by_name
    return {"model": name, "J": m["J"], "k": k, "ops_per_call": ops, "bytecodes_per_call": bytecodes,
            "added_ops": {v: dict((by_op[v] - by_op["petra"]).most_common()) for v in OFFLOADS if v != "petra"},
            **{f"{v}/petra": {"ops": ops[v] / ops["petra"], "bytecodes": bytecodes[v] / bytecodes["petra"]}
               for v in OFFLOADS if v != "petra"}}


# --- host time on layers of negligible cost ---

def negligible_model(args: argparse.Namespace) -> dict[str, Any]:
    """The model of negligible compute that host time and instructions are measured on: RevGPT d 8, seq 4, or
    (``--time-model revnet18``) RevNet18 at the ops sizes, J = 10."""
    if args.time_model == "revnet18":
        return model("revnet18", args)
    return model("revgpt", args, d=8, seq=4, blocks=args.time_blocks, stages=args.time_stages, heads=2)


def variant_calls(m: dict, k: int) -> dict[str, Callable[[], Any]]:
    """One ``train_batch`` of each variant on ``m``'s layers, warmed up to steady state.

    Every variant is built, warmed up and thrown away once first: the first engine of a kind built in a process ran
    about 2% slower than the same engine built after it, likely because it shares its memory with the one-time work
    its build triggers (deepspeed.initialize's imports among it). PETRA against DeepSpeed's engine, each built first
    in turn, 4 runs of 40 rounds: 1.44x built first, 1.415x built second; 1.43x either way after a thrown-away build
    of each."""
    builders = {"petra": lambda: _petra_call(m, k), "petra_unchecked": lambda: _petra_call(m, k, check_finite=False),
                "deepspeed_1f1b_one_stage": lambda: _deepspeed_call(m, k),
                "torch_1f1b_one_stage": lambda: _torch_call(m, k), "plain": lambda: _plain_call(m, k),
                "plain_and_petra_forwards": lambda: _plain_call(m, k, again=_reevaluated_layers(m)),
                "petra_structure": lambda: structure_call(m, k)}

    def built() -> dict[str, Callable[[], Any]]:
        calls = {name: build() for name, build in builders.items()}
        for call in calls.values():
            for _ in range(fill_calls(m["J"], k) + 1):
                call()
        return calls

    built()  # thrown away
    gc.collect()
    return built()


def interleaved(names: list[str], rounds: int) -> list[str]:
    """The order variants are measured in: each round every variant in turn, starting at the next variant each
    round, so that a slow spell of the machine hits them all alike."""
    return [name for r in range(rounds) for name in names[r % len(names):] + names[:r % len(names)]]


def time_variants(args: argparse.Namespace) -> dict:
    """Seconds per ``train_batch`` of each variant on the same negligible layers, rounds interleaved."""
    m, k = negligible_model(args), args.k
    calls = variant_calls(m, k)
    rounds: dict[str, list[float]] = {name: [] for name in calls}
    for name in interleaved(list(calls), args.rounds):
        seconds = []
        for _ in range(args.calls):
            start = time.process_time()
            calls[name]()
            seconds.append(time.process_time() - start)
        rounds[name].append(statistics.median(seconds))
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    J = m["J"]
    return {"J": J, "k": k, "blocks": args.time_blocks, "rounds": rounds, "seconds_per_call": medians,
            "petra_us_per_stage_clock": medians["petra"] / (k * J) * 1e6,
            "deepspeed_us_per_micro_batch_per_stage": medians["deepspeed_1f1b_one_stage"] / k * 1e6,
            **host_instructions.ratios(medians)}


def _petra_call(m: dict, k: int, check_finite: bool = True, seed: int = 0, **settings: Any) -> Callable[[], Any]:
    """One ``train_batch`` of PETRA on ``m``'s stages; ``settings``: more of its ``"petra"`` keys."""
    engine, stream = petra_engine(m, k, petra={"check_finite": check_finite, "seed": seed, **settings}), data(m)
    return lambda: engine.train_batch(stream)


def _deepspeed_call(m: dict, k: int) -> Callable[[], Any]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    module = PipelineModule(layers=m["specs"], num_stages=1, loss_fn=m["loss"], partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": m["size"], "gradient_accumulation_steps": k,
              "optimizer": OPTIMIZER, "steps_per_print": 10**9, "gradient_clipping": CLIPPING}
    engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    stream = data(m)
    return lambda: engine.train_batch(stream)


def _torch_call(m: dict, k: int) -> Callable[[], Any]:
    from torch.distributed import pipelining

    torch.manual_seed(0)
    module = torch.nn.Sequential(*[spec.build(log=False) for spec in m["specs"]])
    stage = pipelining.PipelineStage(module, 0, 1, torch.device("cpu"))
    schedule = pipelining.Schedule1F1B(stage, k, loss_fn=m["loss"])
    optimizer = torch_optimizer(module.parameters())
    batches = [next(data(m)) for _ in range(k)]
    x, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])

    def call() -> None:
        schedule.step(x, target=labels)
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIPPING)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return call


def structure_call(m: dict, k: int, module: Any = None) -> Callable[[], Any]:
    """PETRA's work per ``train_batch`` without its engine: the same J stages, layers and optimizers, each
    micro-batch through the library's own pieces in turn (a graph-free forward of every stage but the last; the
    last stage's graph and loss; a reconstructing stage's reconstruction, one graph per branch, and its VJPs; a
    recomputation at stage 0 and at a stage that keeps its input), then every stage clipped and stepped. No
    schedule, keyed RNG, NaN watch or messages: what an engine on these layers cannot go below. ``module``: the
    stages' ``PetraPipelineModule`` (default: ``petra_module(m)``'s)."""
    from petra_ds.nn.accumulate import backprop
    from petra_ds.nn.reversible import GraphTape, SequentialTape, as_tuple, detach_leaf, reconstruct, shaped_like
    from petra_ds.nn.window import modules_fixed
    from petra_ds.pipeline.module import layer_module, stage_layers, stage_reversible
    from petra_ds.schedule.clock import reconstructs

    module, J = petra_module(m) if module is None else module, m["J"]
    layers = [stage_layers(module, j) for j in range(J)]
    owners = [torch.nn.ModuleList([layer_module(layer) for layer in stage]) for stage in layers]
    rebuilds = [reconstructs(j, J, r) for j, r in enumerate(stage_reversible(module))]
    params = [list(owner.parameters()) for owner in owners]  # found once, as the engine's stages keep them
    optimizers, stream = [torch_optimizer(p) for p in params], data(m)

    def run(j: int, x: Any) -> Any:
        for layer in layers[j]:
            x = layer(x)
        return x

    def recomputed(j: int, x: Any, dy: Any) -> Any:
        with torch.enable_grad():
            leaf = x if j == 0 else detach_leaf(x)
            out = run(j, leaf)
        return GraphTape(leaf, out, owners[j]).backward(dy)

    def micro_batch(x: Any, labels: Any) -> None:
        inputs = [x]
        with torch.no_grad():
            for j in range(J - 1):
                inputs.append(run(j, inputs[-1]))
        with torch.enable_grad():
            leaf = detach_leaf(inputs[-1])
            loss = m["loss"](run(J - 1, leaf), labels)
        dy = shaped_like(leaf, backprop([loss / k], [None], as_tuple(leaf), owners[-1]))
        for j in range(J - 2, -1, -1):
            if rebuilds[j]:
                y, tapes = inputs[j + 1], []
                for layer in reversed(layers[j]):
                    y, tape = reconstruct(layer, y)
                    tapes.append(tape)
                dy = SequentialTape(tapes).backward(dy)
            else:
                dy = recomputed(j, inputs[j], dy)

    def call() -> None:
        with modules_fixed():
            for _ in range(k):
                micro_batch(*next(stream))
        for stage, optimizer in zip(params, optimizers):
            torch.nn.utils.clip_grad_norm_(stage, CLIPPING)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return call


def _reevaluated_layers(m: dict) -> int:
    """How many layers, from the first, PETRA evaluates twice per micro-batch: those of every stage but the last
    (a graph-free forward, then the reconstruction or recomputation that the backward differentiates)."""
    return petra_module(m).petra_parts[-2]


def _plain_call(m: dict, k: int, dtype: str = "fp32", again: int = 0) -> Callable[[], Any]:
    """A plain backprop ``train_batch``: k forward + backward passes, clipping, one optimizer step. ``again``:
    the first ``again`` layers also run a graph-free forward per micro-batch first (PETRA's arithmetic, without
    its machinery: the floor of its host time)."""
    layers, run = plain_model(m, dtype)
    step, stream = PlainStep(layers.parameters(), dtype), data(m)

    def call() -> None:
        for _ in range(k):
            x, labels = next(stream)
            if again:
                with torch.no_grad():
                    run(x, layers[:again])
            step.loss(m["loss"](run(x), labels) / k).backward()
        step()
        step.zero_grad()

    return call


def count_instructions(args: argparse.Namespace) -> dict:
    """Host instructions per ``train_batch`` of each variant of ``time``, counted by callgrind in a second run of
    this benchmark (:mod:`.host_instructions`)."""
    m = negligible_model(args)
    sizes = [f"--{name.replace('_', '-')}={getattr(args, name)}"
             for name in (*FULL, "instruction_rounds", "time_model")]
    counts, missed = host_instructions.count(["--parts", "instructions", *sizes], args.instruction_rounds, args.calls)
    return host_instructions.summarize(counts, m["J"], args.k, missed)


def run_windows(args: argparse.Namespace) -> None:
    """Under callgrind: build every variant, then run its counted windows and write their order."""
    one_cpu_process()
    calls = variant_calls(negligible_model(args), args.k)
    order = interleaved(list(calls), args.instruction_rounds)
    host_instructions.windows(calls, order, args.calls)
    write_text_atomic(os.path.join(args.windows_to, "order.json"), json.dumps(order))


# --- the report ---

def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    """The report of the parts ``args`` names; ``argv``: the command line it records (default: this process's)."""
    argv = sys.argv[1:] if argv is None else argv
    report: dict[str, Any] = {"command": "python -m benchmarks.host_overhead " + " ".join(argv),
                              "machine": f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                              "torch": torch.__version__, "sizes": {n: getattr(args, n) for n in FULL},
                              "time_model": args.time_model}
    if "time" in args.parts:  # first, in a process that has built nothing else: the counting parts' engines and
        report["time"] = time_variants(args)  # garbage slowed PETRA's host by a fifth when it came after them
    if "instructions" in args.parts:
        report["instructions"] = count_instructions(args)
        if "time" in report:  # the same variants timed: how much of their time the two counts explain
            report["cost_fit"] = host_instructions.cost_fit(
                report["time"]["seconds_per_call"], report["instructions"]["median_per_call"],
                report["instructions"]["last_level"]["median_misses_per_call"])
    if "ops" in args.parts:
        report["ops"] = [count_ops(name, args, dtype, check_finite)
                         for name in args.models for dtype in args.dtypes for check_finite in (True, False)]
        for row in report["ops"]:
            off = next(r for r in report["ops"] if r["model"] == row["model"] and r["dtype"] == row["dtype"]
                       and not r["check_finite"])
            row["check_finite_cost"] = row["petra_ops"] / off["petra_ops"] - 1
        report["ops_graphs"] = []  # what a CUDA-graphed clock launches, counted with the graphs' eager stand-ins
        for name in args.models:
            for dtype in args.dtypes:
                row = count_ops(name, args, dtype, plain=False, graphs=True)
                eager = next(r for r in report["ops"] if r["model"] == name and r["dtype"] == row["dtype"]
                             and r["check_finite"])
                row.update(plain_ops=eager["plain_ops"], ratio=row["petra_ops"] / eager["plain_ops"],
                           eager_petra_ops=eager["petra_ops"])
                report["ops_graphs"].append(row)
    if "syncs" in args.parts:
        report["syncs"] = [count_syncs(name, args, dtype) for name in args.models for dtype in args.dtypes]
    if "bytecodes" in args.parts:
        report["bytecodes"] = [count_bytecodes(name, args) for name in args.models]
    if "offload" in args.parts:
        report["offload"] = [count_offload(name, args) for name in args.models]
    return report


def print_report(report: dict) -> None:
    for row in report.get("ops", []):
        stages = ", ".join(f"{s['stage']} {s['kind']} {s['ratio']:.2f}x" for s in row["stages"])
        print(f"ops/micro-batch {row['model']:8s} {row['dtype']} check_finite={row['check_finite']!s:5s}: "
              f"PETRA {row['petra_ops']:.0f} vs plain {row['plain_ops']:.0f} = {row['ratio']:.3f}x "
              f"(check_finite +{row['check_finite_cost']:.1%}); tensors CUDA's foreach kernels would take one by "
              f"one: {row['petra_foreach_dragged']:g}; per stage: {stages}")
    for row in report.get("ops_graphs", []):
        print(f"launches/micro-batch with cuda_graphs {row['model']:8s} {row['dtype']}: PETRA {row['petra_ops']:.0f} "
              f"({row['graph_replays']:.0f} graph replays holding {row['in_graphs_ops']:.0f} ops) vs plain "
              f"{row['plain_ops']:.0f} = {row['ratio']:.3f}x (eager PETRA {row['eager_petra_ops']:.0f})")
    for row in report.get("syncs", []):
        print(f"host syncs per train_batch {row['model']:8s} {row['dtype']}: {row['syncs']} {row['where']}")
    for row in report.get("bytecodes", []):
        engine = {area: n for area, n in row["by_area"]["petra"].items() if area.startswith("petra_ds.")}
        print(f"Python bytecodes per train_batch {row['model']:8s} fp32: "
              + ", ".join(f"{n} {c / 1e3:.1f} K" for n, c in row["per_call"].items())
              + f"; PETRA/plain {row['petra/plain']:.2f}x, PETRA/DeepSpeed {row['petra/deepspeed']:.2f}x, "
              f"PETRA/structure {row['petra/structure']:.2f}x; PETRA's in petra_ds: "
              + ", ".join(f"{area[9:]} {n / 1e3:.1f} K" for area, n in engine.items()))
    for row in report.get("offload", []):
        print(f"what the offloads add per train_batch {row['model']:8s} fp32: " + "; ".join(
            f"{v} ops {row[f'{v}/petra']['ops']:.2f}x, bytecodes {row[f'{v}/petra']['bytecodes']:.2f}x PETRA's ("
            + ", ".join(f"{op} +{n}" for op, n in row["added_ops"][v].items()) + ")" for v in row["added_ops"]))
    if "instructions" in report:
        t = report["instructions"]
        print(f"host instructions per train_batch ({report['time_model']} negligible, J={t['J']}, k={t['k']}, "
              "callgrind): "
              + ", ".join(f"{n} {c / 1e6:.1f} M" for n, c in t["median_per_call"].items()) + _ratios(t))
        t = t["last_level"]
        print(f"last-level misses per train_batch (callgrind, {t['cache']['bytes'] >> 10} KiB simulated): "
              + ", ".join(f"{n} {c / 1e3:.1f} K" for n, c in t["median_misses_per_call"].items())
              + f"; PETRA/DeepSpeed {t['petra/deepspeed']:.2f}x, petra_structure/DeepSpeed "
              f"{t['structure/deepspeed']:.2f}x")
    if "cost_fit" in report:
        f = report["cost_fit"]
        print(f"time fitted as {f['seconds_per_instruction'] * 1e9:.3f} ns an instruction + "
              f"{f['seconds_per_miss'] * 1e9:.1f} ns a last-level miss (largest misfit {f['largest_misfit']:.1%}): "
              + "; ".join(f"PETRA over {over} {e['seconds'] * 1e3:.2f} ms, of it instructions "
                          f"{e['instructions_seconds'] * 1e3:.2f} ms and misses {e['misses_seconds'] * 1e3:.2f} ms"
                          for over, e in (("deepspeed", f["petra_over_deepspeed"]),
                                          ("structure", f["petra_over_structure"]))))
    if "time" in report:
        t = report["time"]
        print(f"host time per train_batch ({report['time_model']} negligible, J={t['J']}, k={t['k']}): "
              + ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in t["seconds_per_call"].items()) + _ratios(t)
              + f"; PETRA {t['petra_us_per_stage_clock']:.0f} us per stage-clock, "
              f"DeepSpeed {t['deepspeed_us_per_micro_batch_per_stage']:.0f} us per micro-batch per stage")


def _ratios(t: dict) -> str:
    """PETRA against the other variants, as the ``time`` and ``instructions`` parts both report them."""
    return (f"; PETRA/DeepSpeed {t['petra/deepspeed']:.2f}x, PETRA/torch {t['petra/torch']:.2f}x, "
            f"PETRA/plain {t['petra/plain']:.2f}x; PETRA's arithmetic alone (plain + its graph-free forwards) "
            f"{t['arithmetic_floor/deepspeed']:.2f}x DeepSpeed; its work without the engine (petra_structure) "
            f"{t['structure/deepspeed']:.2f}x; PETRA with check_finite off {t['unchecked/deepspeed']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.windows_to:
        run_windows(args)
        return 0
    one_cpu_process()
    report = run(args, argv)
    print_report(report)
    name = f"host_overhead_cpu{'_tiny' if args.tiny else ''}.json"
    output = args.output or os.path.join("benchmarks", "results", name)
    print(f"saved {save_report(output, report)}")
    return 0


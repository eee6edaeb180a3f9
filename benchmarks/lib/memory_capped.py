"""The user's real choice: under a per-rank memory cap, which schedule trains fastest?

    OMP_NUM_THREADS=1 python -m benchmarks.memory capped --model revgpt --stages 2 --global-batch 32 \\
        --micro-batch-sizes 2 4 8 16 --rounds 5

Every schedule (PETRA and its peers, checkpointed or not: a ``_ckpt`` variant is the same schedule with
checkpointing on) runs the throughput benchmark (``python -m benchmarks.peers``) at every micro-batch size b of
``--micro-batch-sizes``, with k = global batch / b micro-batches per step, so every configuration trains the same
samples per step. Each run gives samples/s and every rank's peak memory as the allocator sees it
(``petra_ds.diagnostics.allocated``; ``torch.cuda.max_memory_allocated`` on a GPU). The caps are PETRA's own peak
(its largest rank) at each micro-batch size. Under each cap, each schedule's best configuration is its fastest
(median samples/s over the rounds) whose largest rank fits; a schedule with none "does not fit". List a size below
the smallest cap you care about: under PETRA's peak at micro-batch b, a peer may fit at b / 2 and lose little speed
(the default 2 4 8 16 lets it, for the caps at 4, 8 and 16). Rounds run every configuration once, in turn, so that
a slow spell of a shared machine hits all of them. ``--partitions default profile`` adds the partition to the
search: every configuration again with each schedule cut by its own measured layer costs (the throughput
benchmark's ``--partition profile``). ``--grains block half`` (RevGPT) adds the grain: every configuration again
with each block as its attention and MLP halves, which a profiled cut may separate (the throughput benchmark's
``--grain``). The caps are PETRA's peaks with the first partition and the first grain listed. A peer's
configuration whose first round peaks above every cap can be chosen under none, so later rounds skip it (its one
round stays in the report, marked ``above_every_cap``; ``--time-all`` times it in every round), unless it was its
schedule's fastest in that round: the choice under no cap, at the report's end (each schedule's fastest
configuration, PETRA's against the fastest peer's), gets every round of it. A torch schedule that refuses k
micro-batches on this many ranks (DualPipeV needs k >= 2 x ranks) is not run at that size; the report lists it
under ``refused``. PETRA, which never flushes, runs any k: searching a micro-batch size with k = 2 shows what that
is worth.

Beside each cap stands PETRA's compute bound there (``ceiling``). At each micro-batch size, every round, the
driver measures the layers' costs (the throughput benchmark's ``--partition profile`` measurement, in this process with
the workers' thread count); a cut's bound is b over its slowest stage's compute per clock
(``petra_ds.pipeline.partition.stage_cost``, PETRA's rule: a stage before the last runs its forward, rebuilds
its graph and runs its backward; the last runs forward and backward once), median over the rounds. It leaves
out messages, the optimizer step and the engine, so it estimates what a PETRA clock on those layers could
reach; it is not a proof (layers timed alone, one at a time, on an idle core). Each PETRA configuration gets
the bound of the cut it ran and its fraction of it; each cap, the best bound of the PETRA configurations that
fit, and the bound at the best cut of the sizes that fit (that cut's peak is known only where a searched
configuration ran it), each over the fastest fitting peer.

Writes ``runs/benchmarks/memory_capped_<model>_<device>.json`` (``--output`` to choose) and prints the table.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile

import torch

from petra_ds.perf.torch_programs import UnsupportedMicroBatches, rank_actions
from petra_ds.pipeline.partition import LayerCost, balanced_parts, stage_costs

from . import throughput, torch_pipe
from .example_runs import save_report

MIB = 2 ** 20
SCHEDULES = ["petra", "1f1b", "1f1b_ckpt", "torch_zbv", "torch_zbv_ckpt", "torch_dualpipev", "torch_dualpipev_ckpt"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["revgpt", "revnet"], default="revgpt")
    p.add_argument("--stages", type=int, default=2, help="processes, one pipeline rank each")
    p.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step, for every configuration")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--schedules", nargs="+", choices=throughput.VARIANTS, default=SCHEDULES)
    p.add_argument("--partitions", nargs="+", choices=["default", "profile"], default=["default"],
                   help="default: each schedule's default cut (the same blocks per stage); profile: each cut by its "
                        "own measured layer costs")
    p.add_argument("--grains", nargs="+", choices=["block", "half"], default=["block"],
                   help="revgpt: block, one layer per block; half, its attention and MLP halves as two layers")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="timed train_batch calls per run")
    p.add_argument("--time-all", action="store_true",
                   help="time every configuration in every round, also a peer's that peaked above every cap in round 1")
    p.add_argument("--model-args", nargs=argparse.REMAINDER, default=[],
                   help="passed to the throughput benchmark (python -m benchmarks.peers) as they are "
                        "(e.g. --seq-len 256 --layers 8)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    for b in args.micro_batch_sizes:
        if b < 1 or args.global_batch % b:
            p.error(f"--micro-batch-sizes {b} must divide --global-batch {args.global_batch}")
    if args.model != "revgpt" and args.grains != ["block"]:
        p.error("--grains half needs --model revgpt: only RevGPT's blocks come as halves")
    if "petra" not in args.schedules:
        p.error("--schedules must include petra: its peaks are the caps")
    return args


def label(b: int, partition: str, grain: str = "block") -> str:
    """A configuration's key in the report: the micro-batch size, then the partition and the grain where they are
    not the defaults."""
    return " ".join([str(b)] + [partition] * (partition != "default") + [grain] * (grain != "block"))


def run(args: argparse.Namespace, b: int, partition: str, grain: str, schedules: list[str]) -> dict[str, dict]:
    """One round at micro-batch size ``b``, ``partition`` and ``grain``: each of ``schedules``' samples/s, largest
    rank's peak bytes and cut (layer boundaries)."""
    cut = [] if partition == "default" else ["--partition", partition]
    layers = [] if grain == "block" else ["--grain", grain]
    variants = throughput.report_of([
        "--model", args.model, "--stages", str(args.stages), "--micro-batch-size", str(b), "--micro-batches",
        str(args.global_batch // b), "--warmup", "2", "--calls", str(args.calls), "--no-costs", *cut,
        "--variants", *schedules, *layers, *args.model_args])["variants"]
    return {v: {"samples_per_s": variants[v]["samples_per_s"], "parts": variants[v].get("parts"),
                "peak": max(r["peak"] for r in variants[v]["peak_allocated"])} for v in schedules}


def compute_bound(costs: list[LayerCost], micro_batch_size: int, parts: list[int]) -> float:
    """Samples/s if a PETRA clock took only its slowest stage's compute, the layers ``costs`` cut at ``parts``
    (messages, step and engine left out)."""
    return micro_batch_size / max(stage_costs(costs, parts))


def layer_costs_at(args: argparse.Namespace, b: int, grain: str) -> list[LayerCost]:
    """The layers' costs at micro-batch size ``b`` and ``grain``, measured now in this process (the throughput
    benchmark's measurement for ``--partition profile``)."""
    layers = [] if grain == "block" else ["--grain", grain]
    model = throughput.parse_args(["--model", args.model, "--stages", str(args.stages), "--micro-batch-size", str(b),
                                   *layers, *args.model_args])
    with tempfile.TemporaryDirectory() as tmp:
        return throughput.measure_costs(model, os.path.join(tmp, "layer_costs.json"))


def bounds(petra: dict[str, dict], costs: dict[tuple, list[list[LayerCost]]], stages: int) -> dict[str, dict]:
    """Writes into each of PETRA's configurations ``petra`` (with the ``parts`` it ran) its cut's
    :func:`compute_bound` (median over the rounds of ``costs``, keyed by micro-batch size and grain) and its
    measured fraction of it; returns, per micro-batch size and grain, the bound at the best cut of each
    round's costs."""
    for c in petra.values():
        rounds = costs[c["micro_batch_size"], c["grain"]]
        c["compute_bound"] = statistics.median(compute_bound(x, c["micro_batch_size"], c["parts"]) for x in rounds)
        c["of_compute_bound"] = c["median_samples_per_s"] / c["compute_bound"]
    best = {}
    for (b, g), rounds in costs.items():
        cuts = [balanced_parts(x, stages) for x in rounds]
        best[label(b, "default", g)] = {"micro_batch_size": b, "grain": g, "best_cuts": cuts, "compute_bound":
                                        statistics.median(compute_bound(x, b, p) for x, p in zip(rounds, cuts))}
    return best


def ceiling_under(cap: float, petra: dict[str, dict], best_cuts: dict[str, dict], peer: float | None) -> dict | None:
    """Under ``cap``: the best compute bound of PETRA's configurations that fit (each at the cut it ran), and the
    best bound at the best cut (see :func:`bounds`) of the micro-batch sizes and grains that fit, each over the
    fastest fitting peer's samples/s ``peer`` (None: no peer fits); None if no PETRA configuration fits."""
    fitting = [(k, c) for k, c in petra.items() if c["peak"] <= cap]
    if not fitting:
        return None
    key, ran = max(fitting, key=lambda kc: kc[1]["compute_bound"])
    best = max((best_cuts[label(c["micro_batch_size"], "default", c["grain"])] for _, c in fitting),
               key=lambda c: c["compute_bound"])
    return {"at_cut_run": {"config": key, "compute_bound": ran["compute_bound"],
                           "over_fastest_peer": None if peer is None else ran["compute_bound"] / peer},
            "at_best_cut": {"micro_batch_size": best["micro_batch_size"], "grain": best["grain"],
                            "compute_bound": best["compute_bound"],
                            "over_fastest_peer": None if peer is None else best["compute_bound"] / peer}}


def above_every_cap(rounds: dict[str, dict[tuple, list[dict]]], cap_configs: list[tuple]) -> set[tuple[str, tuple]]:
    """(schedule, configuration) of each peer configuration whose first round peaked above PETRA's peak in every
    configuration of ``cap_configs`` (no cap can choose it), except each peer's fastest in that round (the
    choice under no cap may)."""
    largest = max(rounds["petra"][c][0]["peak"] for c in cap_configs)
    fastest = {s: max(per_config, key=lambda c: per_config[c][0]["samples_per_s"]) for s, per_config in rounds.items()}
    return {(s, c) for s, per_config in rounds.items() if s != "petra"
            for c, rs in per_config.items() if rs[0]["peak"] > largest and c != fastest[s]}


def refusal(schedule: str, ranks: int, k: int) -> str | None:
    """Why torch's ``schedule`` does not run ``k`` micro-batches on ``ranks`` ranks, or None if it does (PETRA
    and DeepSpeed's schedules run any k)."""
    if schedule not in torch_pipe.VARIANTS:
        return None
    try:
        rank_actions(schedule, ranks, k)
    except UnsupportedMicroBatches as e:
        return str(e)
    return None


def best_under(cap: float, configs: dict[str, dict]) -> dict | None:
    """The fastest configuration (by median samples/s) whose peak fits under ``cap``, or None."""
    fitting = [c for c in configs.values() if c["peak"] <= cap]
    return max(fitting, key=lambda c: c["median_samples_per_s"], default=None)


def choice(cap: float, configs: dict[str, dict[str, dict]], best_cuts: dict[str, dict] | None = None) -> dict:
    """Under ``cap``: each schedule's best fitting configuration, the fastest peer's name and PETRA's samples/s
    over that peer's; with ``best_cuts`` (see :func:`bounds`) also PETRA's compute bounds there
    (:func:`ceiling_under`)."""
    best = {s: best_under(cap, per_schedule) for s, per_schedule in configs.items()}
    peers = {s: c for s, c in best.items() if s != "petra" and c is not None}
    fastest = max(peers, key=lambda s: peers[s]["median_samples_per_s"], default=None)
    row = {"best": best, "fastest_peer": fastest, "petra_over_fastest_peer": None if fastest is None else
           best["petra"]["median_samples_per_s"] / peers[fastest]["median_samples_per_s"]}
    if best_cuts is not None:
        row["ceiling"] = ceiling_under(cap, configs["petra"], best_cuts,
                                       None if fastest is None else peers[fastest]["median_samples_per_s"])
    return row


def print_choice(row: dict, peer: str = "fastest fitting peer") -> None:
    for s, c in row["best"].items():
        fit = "does not fit" if c is None else (
            f"{c['median_samples_per_s']:8.2f} samples/s at micro-batch {c['micro_batch_size']} ({c['partition']} "
            f"partition, {c['grain']} grain), peak {c['peak'] / MIB:.2f} MiB"
            + (f", {c['of_compute_bound']:.1%} of its compute bound" if "of_compute_bound" in c else ""))
        print(f"  {s:22s} {fit}")
    ratio = row["petra_over_fastest_peer"]
    print(f"  PETRA / {peer} ({row['fastest_peer']}): "
          + ("no peer fits" if ratio is None else f"{ratio:.3f}x"))
    top = row.get("ceiling")
    if top is not None:
        ran, cut = top["at_cut_run"], top["at_best_cut"]
        over = [f", {x['over_fastest_peer']:.3f}x the {peer}" if x["over_fastest_peer"] else "" for x in (ran, cut)]
        print(f"  PETRA's compute bound: {ran['compute_bound']:.2f} samples/s at {ran['config']}{over[0]}; at the best "
              f"cut {cut['compute_bound']:.2f} at micro-batch {cut['micro_batch_size']}{over[1]}")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    grid = [(b, p, g) for g in args.grains for p in args.partitions for b in args.micro_batch_sizes]
    refused = {s: {label(*bpg): why for bpg in grid if (why := refusal(s, args.stages, args.global_batch // bpg[0]))}
               for s in args.schedules}
    rounds: dict[str, dict[tuple, list[dict]]] = {s: {bpg: [] for bpg in grid if label(*bpg) not in refused[s]}
                                                  for s in args.schedules}
    cap_configs = [(b, args.partitions[0], args.grains[0]) for b in args.micro_batch_sizes]
    skip: set[tuple[str, tuple]] = set()
    costs: dict[tuple, list[list[LayerCost]]] = {(b, g): [] for g in args.grains for b in args.micro_batch_sizes}
    for r in range(args.rounds):
        for b, grain in costs:
            costs[b, grain].append(layer_costs_at(args, b, grain))
        for b, partition, grain in grid:
            schedules = [s for s in args.schedules if (b, partition, grain) in rounds[s]
                         and (s, (b, partition, grain)) not in skip]
            print(f"round {r + 1}/{args.rounds}, micro-batch {b}, k = {args.global_batch // b}, partition {partition}, "
                  f"grain {grain}: {' '.join(schedules)}", flush=True)
            for schedule, result in run(args, b, partition, grain, schedules).items():
                rounds[schedule][b, partition, grain].append(result)
        if r == 0 and not args.time_all:
            skip = above_every_cap(rounds, cap_configs)
    configs = {s: {label(b, p, g): {"micro_batch_size": b, "partition": p, "grain": g,
                                    "above_every_cap": (s, (b, p, g)) in skip,
                                    "median_samples_per_s": statistics.median(x["samples_per_s"] for x in rs),
                                    "rounds_samples_per_s": [x["samples_per_s"] for x in rs],
                                    "peak": max(x["peak"] for x in rs), "parts": rs[0]["parts"]}
                   for (b, p, g), rs in per_config.items()} for s, per_config in rounds.items()}
    best_cuts = bounds(configs["petra"], costs, args.stages)
    caps = {b: configs["petra"][label(*config)]["peak"] for b, config in zip(args.micro_batch_sizes, cap_configs)}
    table = [{"cap": cap, "petra_micro_batch": b, **choice(cap, configs, best_cuts)} for b, cap in caps.items()]
    unconstrained = choice(math.inf, configs, best_cuts)
    report = {"command": "python -m benchmarks.memory capped " + " ".join(argv), "device": throughput.device_name(),
              "torch": torch.__version__, "args": vars(args), "configs": configs, "refused": refused,
              "best_cuts": best_cuts, "caps": table, "unconstrained": unconstrained}
    tag = "gpu" if torch.cuda.is_available() else "cpu"
    output = args.output or os.path.join("runs", "benchmarks", f"memory_capped_{args.model}_{tag}.json")
    save_report(output, report)
    for row in table:
        print(f"cap {row['cap'] / MIB:.2f} MiB (PETRA's peak at micro-batch {row['petra_micro_batch']}):")
        print_choice(row)
    for s, why in refused.items():
        if why:
            print(f"{s} not run at micro-batch {', '.join(why)}: torch refuses k (e.g. {next(iter(why.values()))})")
    print("no cap (each schedule's fastest configuration; one timed once has one round):")
    print_choice(unconstrained, "fastest peer")
    print(f"saved {output}")
    return report

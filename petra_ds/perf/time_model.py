"""Replay pipeline instruction streams with measured costs: time per micro-batch and Gantt charts.

This module holds the command line and the charts; the model lives beside it: ``costs`` (a stage's
measured primitives), ``programs`` (the schedules lowered into programs: what each instruction costs
and how it communicates), ``torch_programs`` (torch.distributed.pipelining's schedules, lowered alike),
``simulator`` (the event simulator), ``predict`` (time per micro-batch, validation against a throughput
report) and ``measure`` (timing with torch). Their public names are re-exported here.

``naive_mp_rev`` is the paper's "Rev. backprop." baseline of Tab. 5: model parallelism without overlap,
where the reversible stages rebuild their inputs in the backward instead of storing activations.

    python -m petra_ds.perf.time_model                     # Tab. 5 picture: RevNet18 (J=10), RevNet34 (J=18)
    python -m petra_ds.perf.time_model --uniform --stages 4 --micro-batches 4
    python -m petra_ds.perf.time_model --validate benchmarks/results/throughput_revgpt_cpu.json
    python -m petra_ds.perf.time_model --extrapolate benchmarks/results/throughput_revgpt_cpu_redesign.json

Reports and Gantt charts go to ``--out-dir``, by default ``runs/benchmarks/``; the committed ones in
``benchmarks/results/`` are rewritten only with ``--out-dir benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from typing import Any, Mapping, Sequence

import torch

from ..util.files import save_figure, write_text_atomic
from .costs import Costs, StageCosts
from .measure import measure_message_seconds, measure_stage_costs, revnet_costs
from .predict import VARIANTS, predict, report_costs, seconds_per_micro_batch, validate
from .programs import GPipeSchedule, simulate_schedule
from .simulator import Simulation, simulate
from .torch_programs import SCHEDULES

__all__ = [
    "Costs",
    "GPipeSchedule",
    "PAPER_TAB5",
    "Simulation",
    "StageCosts",
    "VARIANTS",
    "measure_message_seconds",
    "measure_stage_costs",
    "plot_gantt",
    "predict",
    "revnet_costs",
    "seconds_per_micro_batch",
    "simulate",
    "simulate_schedule",
    "validate",
]

#: paper Tab. 5: model -> (J, Rev. backprop. ms, PETRA ms) per micro-batch of 256 CIFAR-10 images
PAPER_TAB5 = {18: (10, 160.3, 53.4), 34: (18, 235.6, 97.1)}
#: where the reports and charts go unless --out-dir says (not the committed benchmarks/results/)
RESULTS = os.path.join("runs", "benchmarks")


# --- Gantt charts -------------------------------------------------------------------------------

COLORS = {"forward": "#4c78a8", "forward_grad": "#1f3f73", "reconstruct": "#f58518", "recompute": "#f2b25c",
          "backward": "#54a24b", "backward_input": "#88d27a", "backward_weight": "#2e6b27", "step": "#7f7f7f",
          "message": "#e45756"}
LABELS = {"forward": "forward", "forward_grad": "forward with graph", "reconstruct": "reconstruct (inverse)",
          "recompute": "recompute", "backward": "backward", "backward_input": "input gradient",
          "backward_weight": "weight gradient", "step": "optimizer step", "message": "transfer"}


def plot_gantt(simulations: Sequence[Simulation], path: str, title: str = "", time_unit: str = "ms") -> str:
    """One panel per simulation, one row per stage (stage 0 on top), a colour per op, micro-batch numbers
    on the bars wide enough to hold them; all panels share the time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[time_unit]
    span = max(s.meta.get("span", s.makespan) for s in simulations) * scale or 1.0
    width_in = 13.0
    rows = sum(s.stage_count for s in simulations)
    fig, axes = plt.subplots(len(simulations), 1, sharex=True, squeeze=False,
                             figsize=(width_in, 1.2 + 0.28 * rows + 0.5 * len(simulations)))
    char = span * 0.0065 * 13.0 / width_in  # the width of one digit of the labels, in time units
    used = set()
    for ax, sim in zip(axes[:, 0], simulations):
        for e in sim.events:
            start, dur = e.start * scale, (min(e.end * scale, span) - e.start * scale)
            message = e.op == "message"  # a thin bar under the row: transfers may overlap compute
            row, height = (e.stage + 0.36, 0.1) if message else (e.stage, 0.7)
            ax.barh(row, dur, left=start, height=height, color=COLORS.get(e.op, "black"),
                    edgecolor="none" if message else "white", linewidth=0.3)
            used.add(e.op)
            if e.micro_batch is not None and dur >= char * (len(str(e.micro_batch)) + 1):
                ax.text(start + dur / 2, row, str(e.micro_batch), ha="center", va="center", fontsize=6,
                        color="white")
        ax.set_ylim(sim.stage_count - 0.5, -0.5)
        ticks = range(sim.stage_count) if sim.stage_count <= 10 else range(0, sim.stage_count, 2)
        ax.set_yticks(list(ticks))
        ax.set_ylabel("stage")
        ax.set_title(sim.name, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel(f"time ({time_unit})")
    axes[-1, 0].set_xlim(0, span)
    handles = [Patch(color=COLORS[op], label=LABELS[op]) for op in COLORS if op in used]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def gantt_panels(costs: Costs, micro_batches: int, *, reversible: Sequence[bool] | None = None,
                 schedules: Sequence[str] = ("petra", "1f1b", "gpipe", "naive_mp"),
                 steady_windows: int = 3) -> list[Simulation]:
    """The same stretch of wall time for every schedule from a cold start: as long as PETRA takes to fill
    its pipeline and run ``steady_windows`` more windows; each panel is titled with its steady-state time
    per micro-batch and ``meta["span"]`` holds the stretch."""
    J, k = costs.stage_count, micro_batches
    petra_windows = math.ceil((2 * J - 1) / k) + steady_windows
    span = simulate_schedule("petra", costs, k, petra_windows, reversible=reversible).batch_ends[-1]
    sims = []
    for name in schedules:
        steady = seconds_per_micro_batch(name, costs, k, reversible=reversible)
        if name == "petra":
            batches = petra_windows
        else:
            per_batch = 1 if name.startswith("naive_mp") else k
            batches = math.ceil(span / (steady * per_batch)) + 1
        sim = simulate_schedule(name, costs, k, batches, reversible=reversible)
        sim.events = [e for e in sim.events if e.start < span]
        finished = Counter(e.micro_batch for e in sim.events
                           if e.stage == 0 and e.op in ("backward", "backward_weight") and e.end <= span)
        done = sum(n == sim.meta.get("stages_per_rank", 1) for n in finished.values())  # all of row 0's parts
        sim.name = (f"{_NAMES.get(name, name)}: {1e3 * steady:.3g} ms per micro-batch in steady state; "
                    f"{done} micro-batches done in this stretch")
        sim.meta["span"] = span
        sims.append(sim)
    return sims


_NAMES = {"petra": "PETRA", "1f1b": "1F1B (DeepSpeed TrainSchedule)", "gpipe": "GPipe",
          "naive_mp": "naive model parallelism", "naive_mp_ckpt": "naive MP + activation checkpointing",
          "naive_mp_rev": "naive MP, reversible backprop (paper's baseline)", "1f1b_rev": "1F1B, reversible backprop",
          "1f1b_ckpt": "1F1B + activation checkpointing", "gpipe_ckpt": "GPipe + activation checkpointing",
          "single": "single process",
          **{name: f"torch {cls}" for name, (cls, _, _) in SCHEDULES.items()},
          **{name + "_ckpt": f"torch {cls} + activation checkpointing" for name, (cls, _, _) in SCHEDULES.items()}}


# --- command line -------------------------------------------------------------------------------


def _table(predictions: Mapping[int, Mapping[str, float]], mbs: int) -> str:
    """ms per micro-batch and samples/s of every variant at each k; n/a where torch's schedule refuses k."""
    ks = sorted(predictions)
    names = list(dict.fromkeys([*VARIANTS, *(v for k in ks for v in predictions[k])]))
    width = max(16, *map(len, names))
    head = f"{'variant':{width}s}" + "".join(f" {'k=' + str(k) + ' ms/mb':>12s} {'samples/s':>10s}" for k in ks)
    lines = [head]
    for v in names:
        cells = [f" {1e3 * predictions[k][v]:12.2f} {mbs / predictions[k][v]:10.1f}" if v in predictions[k]
                 else f" {'n/a':>12s} {'':10s}" for k in ks]
        lines.append(f"{v:{width}s}" + "".join(cells).rstrip())
    return "\n".join(lines)


def _revnet_report(args: argparse.Namespace) -> dict[str, Any]:
    args.k = args.k or [1, 4, 16]
    saved: dict[str, Any] = {"models": {}}
    if args.costs_from:
        with open(args.costs_from) as f:
            saved = json.load(f)
    report: dict[str, Any] = {"command": args.command, "measured_by": saved.get("measured_by", args.command),
                              "micro_batch_size": args.micro_batch,
                              "threads": saved.get("threads", torch.get_num_threads()),  # of the measurement
                              "message_s": args.message_s, "models": {}}
    saved = saved["models"]
    for depth in args.depths:
        name = f"revnet{depth}"
        if name in saved:
            costs = Costs.from_dict(saved[name]["costs"])
            reversible, layer_names = saved[name]["reversible"], saved[name]["layers"]
            mbs = saved[name].get("micro_batch_size", args.micro_batch)
        else:
            t0 = time.perf_counter()
            costs, reversible, layer_names = revnet_costs(depth, args.micro_batch, repeats=args.repeats)
            mbs = args.micro_batch
            print(f"measured RevNet{depth} ({len(layer_names)} stages) in {time.perf_counter() - t0:.0f} s")
        costs = Costs(costs.stages, args.message_s)
        J = costs.stage_count
        preds = {k: predict(costs, k, reversible=reversible) for k in args.k}
        per_stage = [s.forward + s.forward_grad + s.backward for s in costs.stages]
        print(f"\nRevNet{depth}, J = {J}, micro-batch {mbs}, message {1e3 * args.message_s:g} ms, "
              f"costs measured with {report['threads']} thread(s)")
        print("stage costs (ms): " + ", ".join(f"{j}:{name_}{'' if rev else '*'} "
                                             f"f={1e3 * s.forward:.1f}/fg={1e3 * s.forward_grad:.1f}/"
                                             f"b={1e3 * s.backward:.1f}"
                                             for j, (name_, rev, s) in enumerate(zip(layer_names, reversible,
                                                                                     costs.stages))))
        print(_table(preds, mbs))
        ratios = {k: {f"{v}/petra": p[v] / p["petra"] for v in p if v != "petra"} for k, p in preds.items()}
        paper = PAPER_TAB5.get(depth)
        for k in args.k:
            r = ratios[k]
            print(f"k={k}: PETRA's speed-up over Rev. backprop (naive_mp_rev) {r['naive_mp_rev/petra']:.2f}x"
                  + (f" (paper {paper[1] / paper[2]:.1f}x)" if paper else "")
                  + f", over naive MP {r['naive_mp/petra']:.2f}x, 1F1B {r['1f1b/petra']:.2f}x, "
                  f"1F1B reversible {r['1f1b_rev/petra']:.2f}x, GPipe {r['gpipe/petra']:.2f}x, "
                  f"single process {r['single/petra']:.2f}x")
        slowest = max(range(J), key=lambda j: per_stage[j])
        print(f"slowest stage {slowest} ({layer_names[slowest]}): {1e3 * per_stage[slowest]:.1f} ms per clock; "
              f"sum over stages {1e3 * sum(per_stage):.1f} ms; balance sum/(J max) = "
              f"{sum(per_stage) / (J * per_stage[slowest]):.2f}")
        report["models"][name] = {
            "stages": J, "micro_batch_size": mbs, "layers": layer_names, "reversible": list(reversible),
            "costs": costs.to_dict(), "ms_per_micro_batch": {str(k): {v: 1e3 * s for v, s in p.items()}
                                                           for k, p in preds.items()},
            "ratios": {str(k): r for k, r in ratios.items()},
            "paper": None if paper is None else {"stages": paper[0], "rev_backprop_ms": paper[1], "petra_ms": paper[2],
                                                 "speedup": round(paper[1] / paper[2], 2)}}
        if args.gantt:
            png = os.path.join(args.out_dir, f"timeline_{name}_gantt.png")
            k = args.gantt_k
            plot_gantt(gantt_panels(costs, k, reversible=reversible), png,
                       f"RevNet{depth}, J={J}, k={k}, micro-batch {mbs}, CPU-measured stage costs")
            report["models"][name]["gantt"] = png
            print(f"wrote {png}")
    return report


#: the panels of ``--extrapolate``'s Gantt chart, where the schedule runs that k
EXTRAPOLATE_GANTT = ("petra", "1f1b", "torch_1f1b", "torch_interleaved_zb", "torch_zbv", "torch_dualpipev")


def _extrapolate_report(args: argparse.Namespace) -> dict[str, Any]:
    """Predictions at every J of ``--to-stages`` from a throughput report's stages repeated in order
    (:meth:`Costs.stretched`): how the variants compare past the J the benchmark could run."""
    with open(args.extrapolate) as f:
        report = json.load(f)
    measured = report_costs(report)
    mbs = int(report["micro_batch_size"])
    result: dict[str, Any] = {"command": args.command, "source": args.extrapolate, "micro_batch_size": mbs,
                              "costs": measured.to_dict(), "ms_per_micro_batch": {}}
    for J in args.to_stages:
        costs = measured.stretched(J)
        ks = args.k or [J, 2 * J, 4 * J]
        preds = {k: predict(costs, k) for k in ks}
        print(f"\n{os.path.basename(args.extrapolate)}: its {measured.stage_count} measured stages repeated to "
              f"J = {J}, micro-batch {mbs}, message {1e3 * costs.message_s:.3g} ms")
        print(_table(preds, mbs))
        result["ms_per_micro_batch"][str(J)] = {str(k): {v: 1e3 * t for v, t in p.items()} for k, p in preds.items()}
        if args.gantt and J == args.to_stages[0]:
            png = os.path.join(args.out_dir, (args.name or _extrapolate_stem(args)) + "_gantt.png")
            k = ks[0]
            plot_gantt(gantt_panels(costs, k, schedules=[v for v in EXTRAPOLATE_GANTT if v in preds[k]]), png,
                       f"{os.path.basename(args.extrapolate)} stages repeated to J={J}, k={k}")
            result["gantt"] = png
            print(f"wrote {png}")
    return result


def _extrapolate_stem(args: argparse.Namespace) -> str:
    return "timeline_extrapolate_" + os.path.splitext(os.path.basename(args.extrapolate))[0]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--validate", metavar="REPORT", help="compare predictions with a throughput report (JSON)")
    parser.add_argument("--uniform", action="store_true", help="uniform costs (--forward/--forward-grad/--backward)")
    parser.add_argument("--stages", type=int, default=4, help="J, with --uniform")
    parser.add_argument("--micro-batches", type=int, default=4, help="k, with --uniform")
    parser.add_argument("--forward", type=float, default=1.0, help="ms, with --uniform")
    parser.add_argument("--forward-grad", type=float, default=1.0, help="ms, with --uniform")
    parser.add_argument("--backward", type=float, default=2.0, help="ms, with --uniform")
    parser.add_argument("--step", type=float, default=0.0, help="ms, with --uniform")
    parser.add_argument("--depths", type=int, nargs="+", default=[18, 34], help="RevNet depths")
    parser.add_argument("--micro-batch", type=int, default=32, help="RevNet micro-batch for the measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--k", type=int, nargs="+", help="micro-batches per step to predict (default 1 4 16; "
                        "with --extrapolate J 2J 4J)")
    parser.add_argument("--extrapolate", metavar="REPORT", help="predict at every J of --to-stages from the "
                        "per-stage costs of a throughput report (JSON), its stages repeated in order")
    parser.add_argument("--to-stages", type=int, nargs="+", default=[8, 10, 18], help="J, with --extrapolate")
    parser.add_argument("--gantt-k", type=int, default=4)
    parser.add_argument("--message-s", type=float, default=0.0, help="seconds per message between stages")
    parser.add_argument("--costs-from", help="RevNet: reuse the costs of a previous timeline_revnet.json (no "
                        "measurement); --validate: take the costs from this throughput report")
    parser.add_argument("--no-gantt", dest="gantt", action="store_false", help="skip the Gantt charts")
    parser.add_argument("--out-dir", default=RESULTS, help=f"where the JSON and the PNGs go (default {RESULTS})")
    parser.add_argument("--name", default=None, help="output file stem (default depends on the mode)")
    args = parser.parse_args(argv)
    args.command = "python -m petra_ds.perf.time_model " + " ".join(sys.argv[1:] if argv is None else argv)

    if args.validate:
        with open(args.validate) as f:
            report = json.load(f)
        costs = None
        if args.costs_from:
            with open(args.costs_from) as f:
                costs = Costs.from_dict(json.load(f)["costs"])
        result = validate(report, costs=costs)
        print(f"{args.validate}: J = {result['stages']}, k = {result['micro_batches']}, "
              f"micro-batch {result['micro_batch_size']}, DeepSpeed streams {result['ds_streams']}, "
              f"costs from {args.costs_from or args.validate}")
        print(f"{'variant':14s} {'measured/s':>11s} {'predicted/s':>12s} {'error':>7s}")
        for v, r in result["variants"].items():
            print(f"{v:14s} {r['measured_samples_per_s']:11.1f} {r['predicted_samples_per_s']:12.1f} "
                  f"{100 * r['relative_error']:6.1f}%")
        print(f"max |error| {100 * result['max_abs_relative_error']:.1f}% "
              f"({'within' if result['within_tolerance'] else 'OUTSIDE'} {100 * result['tolerance']:.0f}%)"
              + (f"; not modelled: {result['skipped']}" if result["skipped"] else ""))
        stem = args.name or "timeline_validation_" + os.path.splitext(os.path.basename(args.validate))[0]
        result["source"] = args.validate
        result["command"] = args.command
        result["costs_source"] = args.costs_from or args.validate
        if args.gantt:
            png = os.path.join(args.out_dir, stem + "_gantt.png")
            plot_gantt(gantt_panels(Costs.from_dict(result["costs"]), result["micro_batches"]), png,
                       f"{os.path.basename(args.validate)}: J={result['stages']}, k={result['micro_batches']}, "
                       "measured costs")
            result["gantt"] = png
            print(f"wrote {png}")
    elif args.extrapolate:
        result = _extrapolate_report(args)
        stem = args.name or _extrapolate_stem(args)
    elif args.uniform:
        J, k = args.stages, args.micro_batches
        costs = Costs.uniform(J, args.forward / 1e3, args.forward_grad / 1e3, args.backward / 1e3, args.step / 1e3,
                              args.message_s)
        preds = predict(costs, k)
        print(f"uniform costs, J = {J}, k = {k}: forward {args.forward} ms, forward with graph {args.forward_grad} "
              f"ms, backward {args.backward} ms, step {args.step} ms, message {1e3 * args.message_s:g} ms")
        print(_table({k: preds}, 1))
        stem = args.name or f"timeline_uniform_J{J}_k{k}"
        result = {"command": args.command, "stages": J, "micro_batches": k, "costs": costs.to_dict(),
                  "ms_per_micro_batch": {v: 1e3 * s for v, s in preds.items()}}
        if args.gantt:
            png = os.path.join(args.out_dir, stem + "_gantt.png")
            plot_gantt(gantt_panels(costs, k), png,
                       f"uniform costs, J={J}, k={k}: forward {args.forward} ms, with graph {args.forward_grad} ms, "
                       f"backward {args.backward} ms, message {1e3 * args.message_s:g} ms")
            result["gantt"] = png
            print(f"wrote {png}")
    else:
        result = _revnet_report(args)
        stem = args.name or "timeline_revnet"
    path = os.path.join(args.out_dir, stem + ".json")
    os.makedirs(args.out_dir, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=1))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()

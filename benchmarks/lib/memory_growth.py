"""How each schedule's per-rank peak memory grows with the pipeline's depth J and the sequence length.

    OMP_NUM_THREADS=1 python -m benchmarks.memory growth --stages 2 4 8 --seq-lens 128 256 512

For every (J, sequence length) it runs the throughput benchmark (``python -m benchmarks.peers``) on J processes
(one stage each) with a RevGPT of ``--blocks-per-stage`` x J blocks, so every stage holds the same blocks whatever
J (stage 0 adds the embedding, the last the head), k = 2J micro-batches per step, and reads each rank's peak memory
as the allocator sees it (``petra_ds.diagnostics.allocated``: parameters, gradients, optimizer state, activations,
saved tensors, recompute graphs, messages; ``torch.cuda.max_memory_allocated`` on a GPU). The runs time one call
only: this is a memory measurement, and J = 8 on a 2-core machine says nothing about speed. Writes
``runs/benchmarks/memory_growth_<device>.json`` and a PNG (``--output`` to choose) and prints the table: per
schedule, the largest rank's peak and the middle ranks' peak, in MiB.

Then it predicts deeper pipelines (``--predict 18``) with a memory model fitted to those measurements: a
rank's peak is its parameters, gradients and optimizer state, plus a number of bytes per micro-batch whose
activations it holds, plus a constant of its role (first, middle or last rank). How many micro-batches each
rank holds at once comes from the time model's simulation of the schedule (``Simulation.held_micro_batches``),
so a J no machine here can run is predicted from the schedule itself. The model is checked by predicting the
deepest measured J from the shallower ones alone. ``--from-report`` fits a saved report again, without
measuring.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch

from petra_ds.perf import predict
from petra_ds.perf.costs import Costs
from petra_ds.perf.programs import simulate_schedule
from petra_ds.util.files import save_figure

from . import throughput
from .example_runs import save_report

MIB = 2 ** 20
ROLES = ("first", "middle", "last")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8], help="pipeline depths J (processes)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--variants", nargs="+", choices=throughput.VARIANTS,
                   default=["petra", "1f1b", "1f1b_ckpt", "torch_zbv", "torch_dualpipev"])
    p.add_argument("--blocks-per-stage", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--predict", type=int, nargs="*", default=[18], metavar="J",
                   help="depths the memory model fitted to the measurements predicts (none: no model)")
    p.add_argument("--from-report", default=None, metavar="JSON",
                   help="fit and predict from this report's measurements instead of measuring again")
    p.add_argument("--output", default=None, help="JSON report, relative to the repository root "
                   "(default runs/benchmarks/memory_growth_<device>.json); the PNG goes beside it")
    args = p.parse_args(argv)
    if min(args.stages) < 2:
        p.error("--stages: every depth must be at least 2 (one stage per process)")
    return args


def measure(args: argparse.Namespace, J: int, seq_len: int) -> dict[str, list[dict]]:
    """Every variant's per-rank peak_allocated for depth J and ``seq_len``."""
    report = throughput.report_of([
        "--model", "revgpt", "--stages", str(J), "--layers", str(args.blocks_per_stage * J), "--d-model",
        str(args.d_model), "--heads", str(args.heads), "--seq-len", str(seq_len), "--vocab-size", str(args.vocab_size),
        "--micro-batches", str(2 * J), "--micro-batch-size", str(args.micro_batch_size), "--warmup", "2",
        "--calls", "1", "--no-costs", "--variants", *args.variants])
    return {v: report["variants"][v]["peak_allocated"] for v in args.variants}


def summarize(ranks: list[dict]) -> dict[str, float]:
    """MiB: the largest rank's peak, and the median peak of the middle ranks (those that are neither the
    first nor the last stage; the median of all ranks when there are none)."""
    peaks = [r["peak"] / MIB for r in ranks]
    middle = peaks[1:-1] or peaks
    return {"max": max(peaks), "middle": statistics.median(middle), "ranks": peaks}


@functools.lru_cache(maxsize=None)
def held(variant: str, J: int) -> tuple[int, ...]:
    """Per rank, the most micro-batches whose activations ``variant`` holds at once at depth J with k = 2J, from
    the time model's simulation of two steps (``Simulation.held_micro_batches``; the order of operations
    decides it, so unit costs do). Simulated once per schedule and depth: every fit and prediction asks."""
    sim = simulate_schedule(variant, Costs.uniform(J, 1.0, 1.0, 1.0), 2 * J, 2)
    counts = sim.held_micro_batches()
    return tuple(counts[r] for r in range(J))


def role(rank: int, J: int) -> str:
    return "first" if rank == 0 else "last" if rank == J - 1 else "middle"


def fit(rows: list[dict], variant: str, seq_len: int, depths: list[int]) -> dict:
    """The memory model of ``variant`` at ``seq_len``, fitted by least squares to every rank of the rows at
    ``depths``: a rank's peak = its parameters, gradients and optimizer state (those of its role, first,
    middle or last, at the deepest J fitted: each stage holds the same blocks whatever J) + ``per_held``
    bytes per micro-batch it holds (``held``) + a constant of its role (messages, a micro-batch's graph, the
    data or the logits)."""
    import numpy as np

    A, y, static = [], [], {}
    for row in sorted((r for r in rows if r["seq_len"] == seq_len and r["J"] in depths), key=lambda r: r["J"]):
        J = row["J"]
        for rank, (ranks, count) in enumerate(zip(row["per_rank"][variant], held(variant, J))):
            parts = ranks["parts"]
            static.setdefault(J, {}).setdefault(role(rank, J), []).append(ranks["peak"] - parts["other"])
            A.append([count] + [float(role(rank, J) == name) for name in ROLES])
            y.append(parts["other"])
    coef, *_ = np.linalg.lstsq(np.array(A), np.array(y), rcond=None)
    deepest = static[max(static)]
    fixed = {name: statistics.median(deepest.get(name) or deepest["first"]) for name in ROLES}
    return {"per_held": float(coef[0]), "constant": dict(zip(ROLES, map(float, coef[1:]))), "static": fixed}


def predicted_peaks(model: dict, variant: str, J: int) -> list[float]:
    """Every rank's predicted peak in bytes at depth J."""
    return [model["static"][role(r, J)] + model["per_held"] * n + model["constant"][role(r, J)]
            for r, n in enumerate(held(variant, J))]


def predictions(report: dict, depths: list[int]) -> dict:
    """Per schedule the time model knows and sequence length: the model fitted to every measured J, its per-rank
    peaks at each of ``depths`` (summarized like the measurements), and a check of the model on the deepest
    measured J, predicted from the shallower ones alone (``held_out``: predicted and measured largest-rank peak,
    MiB)."""
    measured = sorted({row["J"] for row in report["rows"]})
    out: dict = {}
    for variant in (v for v in report["args"]["variants"] if v in predict.VARIANTS):
        for seq_len in report["args"]["seq_lens"]:
            model = fit(report["rows"], variant, seq_len, measured)
            cell = {"model": model, "at": {str(J): summarize([{"peak": p} for p in predicted_peaks(model, variant, J)])
                                            for J in depths}}
            if len(measured) > 2:
                early = fit(report["rows"], variant, seq_len, measured[:-1])
                deepest = next(r for r in report["rows"] if r["J"] == measured[-1] and r["seq_len"] == seq_len)
                guess = max(predicted_peaks(early, variant, measured[-1])) / MIB
                actual = deepest["variants"][variant]["max"]
                cell["held_out"] = {"J": measured[-1], "predicted": guess, "measured": actual,
                                    "error": guess / actual - 1}
            out.setdefault(variant, {})[str(seq_len)] = cell
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq_lens = report["args"]["seq_lens"]
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(4.2 * len(seq_lens), 3.6), squeeze=False)
    for ax, seq_len in zip(axes[0], seq_lens):
        for variant in report["args"]["variants"]:
            points = [(row["J"], row["variants"][variant]["max"]) for row in report["rows"]
                      if row["seq_len"] == seq_len]
            line, = ax.plot(*zip(*points), marker="o", label=variant)
            model = report.get("predictions", {}).get(variant, {}).get(str(seq_len))
            if model:  # the model's prediction, dashed from the deepest measurement
                ahead = sorted((int(J), at["max"]) for J, at in model["at"].items())
                ax.plot(*zip(points[-1], *ahead), linestyle="--", marker="o", mfc="none", color=line.get_color())
        ax.set_title(f"seq {seq_len}")
        ax.set_xlabel("J (processes; hollow: predicted)")
        ax.set_ylabel("largest rank's peak (MiB)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_report:
        with open(args.from_report) as f:
            report = json.load(f)
        report["args"].update(predict=args.predict)
        report["predicted_by"] = "python -m benchmarks.memory growth " + " ".join(argv)
    else:
        rows = []
        for seq_len in args.seq_lens:
            for J in args.stages:
                print(f"J = {J}, seq {seq_len}: {', '.join(args.variants)}", flush=True)
                measured = measure(args, J, seq_len)
                rows.append({"J": J, "seq_len": seq_len, "k": 2 * J, "per_rank": measured,
                             "variants": {v: summarize(ranks) for v, ranks in measured.items()}})
        report = {"command": "python -m benchmarks.memory growth " + " ".join(argv),
                  "device": throughput.device_name(), "torch": torch.__version__, "args": vars(args), "rows": rows}
    if args.predict and len({row["J"] for row in report["rows"]}) > 1:
        report["predictions"] = predictions(report, args.predict)
    tag = "gpu" if torch.cuda.is_available() else "cpu"
    output = args.output or os.path.join("runs", "benchmarks", f"memory_growth_{tag}.json")
    args, rows = argparse.Namespace(**report["args"]), report["rows"]
    path = save_report(output, report)
    plot(report, os.path.splitext(path)[0] + ".png")
    print(f"{'seq':>5s} {'J':>3s} " + " ".join(f"{v:>24s}" for v in args.variants))
    for row in rows:
        cells = [f"{row['variants'][v]['max']:8.1f} (mid {row['variants'][v]['middle']:7.1f})" for v in args.variants]
        print(f"{row['seq_len']:5d} {row['J']:3d} " + " ".join(f"{c:>24s}" for c in cells))
    for variant, cells in report.get("predictions", {}).items():
        for seq_len, cell in cells.items():
            at = ", ".join(f"J = {J}: {c['max']:.1f} (mid {c['middle']:.1f})" for J, c in cell["at"].items())
            check = cell.get("held_out")
            checked = (f"; J = {check['J']} from the shallower runs: {check['predicted']:.1f} vs measured "
                       f"{check['measured']:.1f} ({check['error']:+.1%})" if check else "")
            print(f"predicted {variant} seq {seq_len}: {at}{checked}")
    print(f"saved {output}")
    return report

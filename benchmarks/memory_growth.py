"""How each schedule's per-rank peak memory grows with the pipeline's depth J and the sequence length.

    OMP_NUM_THREADS=1 python benchmarks/memory_growth.py --stages 2 4 8 --seq-lens 128 256 512

For every (J, sequence length) it runs ``benchmarks/throughput.py`` on J processes (one stage each) with a
RevGPT of ``--blocks-per-stage`` x J blocks, so every stage holds the same blocks whatever J (stage 0 adds
the embedding, the last the head), k = 2J micro-batches per step, and reads each rank's peak memory as the
allocator sees it (``petra_ds.diagnostics.allocated``: parameters, gradients, optimizer state,
activations, saved tensors, recompute graphs, messages; ``torch.cuda.max_memory_allocated`` on a GPU).
The runs time one call only: this is a memory measurement, and J = 8 on a 2-core machine says nothing
about speed. Writes ``runs/benchmarks/memory_growth_<device>.json`` and a PNG (``--output`` to choose) and
prints the table: per schedule, the largest rank's peak and the middle ranks' peak, in MiB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import throughput  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
from example_runs import save_report  # noqa: E402

MIB = 2 ** 20


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
            ax.plot(*zip(*points), marker="o", label=variant)
        ax.set_title(f"seq {seq_len}")
        ax.set_xlabel("J (processes)")
        ax.set_ylabel("largest rank's peak (MiB)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rows = []
    for seq_len in args.seq_lens:
        for J in args.stages:
            print(f"J = {J}, seq {seq_len}: {', '.join(args.variants)}", flush=True)
            measured = measure(args, J, seq_len)
            rows.append({"J": J, "seq_len": seq_len, "k": 2 * J, "per_rank": measured,
                         "variants": {v: summarize(ranks) for v, ranks in measured.items()}})
    report = {"command": "python benchmarks/memory_growth.py " + " ".join(argv),
              "device": throughput.device_name(), "torch": torch.__version__, "args": vars(args), "rows": rows}
    tag = "gpu" if torch.cuda.is_available() else "cpu"
    output = args.output or os.path.join("runs", "benchmarks", f"memory_growth_{tag}.json")
    path = save_report(output, report)
    plot(report, os.path.splitext(path)[0] + ".png")
    print(f"{'seq':>5s} {'J':>3s} " + " ".join(f"{v:>24s}" for v in args.variants))
    for row in rows:
        cells = [f"{row['variants'][v]['max']:8.1f} (mid {row['variants'][v]['middle']:7.1f})" for v in args.variants]
        print(f"{row['seq_len']:5d} {row['J']:3d} " + " ".join(f"{c:>24s}" for c in cells))
    print(f"saved {output}")
    return report


if __name__ == "__main__":
    main()

"""How deep can a pipeline go? PETRA's gap to backprop against the depth J, read from ``accuracy lm`` reports
(one per model: a depth of J stages gets a RevGPT of J - 3 blocks, one block per stage), at the recommended
k = 2(J-1) micro-batches per step (the smallest measured k at or above it) and at half of it.

    python -m benchmarks.accuracy depth --reports benchmarks/results/lm_accuracy_depth_sweep.json \\
        benchmarks/results/lm_accuracy_J16.json --output benchmarks/results/lm_accuracy_depth.json

For each depth and k: the shipped recipe (``muon10+wp``: ``ds_configs/petra_lm.json``'s Muon at 10x the lr and
weight prediction) against backprop with the same optimizer, and the best recipe measured against the best
backprop of any optimizer. Prints the table, saves the JSON and one PNG of the curves (a panel per depth).
"""

from __future__ import annotations

import argparse
import json
import os

from petra_ds.util.files import save_figure

from .example_runs import ROOT, save_report
from .lm_accuracy import loss_panel, run_of

#: the recipe ``ds_configs/petra_lm.json`` ships (``benchmarks/lib/lm_accuracy.py``'s names)
SHIPPED = "muon10+wp"


def recommended_k(stages: int) -> int:
    """The fewest micro-batches per step that keep stage 0 at most one optimizer step behind: 2(J-1)."""
    return 2 * (stages - 1)


def depth_rows(report: dict) -> list[dict]:
    """The report's rows at the recommended k (the smallest measured k >= 2(J-1)) and at the largest measured
    k at or below half of it, per depth, at its longest run."""
    rows = []
    a = report["args"]
    for J in sorted({r["J"] for r in report["best"]}):
        mine = [r for r in report["best"] if r["J"] == J]
        steps = max(r["steps"] for r in mine)
        mine = [r for r in mine if r["steps"] == steps]
        ks = sorted({r["k"] for r in mine})
        above = [k for k in ks if k >= recommended_k(J)]
        below = [k for k in ks if k <= recommended_k(J) // 2]
        for k, which in ((above[0] if above else None, "recommended"), (below[-1] if below else None, "half")):
            if k is None:
                continue
            cell = sorted((r for r in mine if r["k"] == k), key=lambda r: r["val_loss"])
            shipped = next((r for r in cell if r["recipe"] == SHIPPED and r["gap_to_own_optimizer"] is not None),
                           None)
            best = cell[0]
            rows.append({
                "J": J, "blocks": a["layers"], "d_model": a["d_model"], "k": k, "k_is": which, "steps": steps,
                "shipped_gap": None if shipped is None else shipped["gap_to_own_optimizer"],
                "shipped_seeds": None if shipped is None else shipped["seeds"],
                "best_recipe": best["recipe"], "best_lr": best["lr"], "best_gap": best["gap_to_best_backprop"],
                "best_seeds": best["seeds"], "backprop_best": best["backprop_best"],
                "lrs_tried": sorted({r["lr"] for r in report["runs"] if r["J"] == J}),
                "source": report["source"]})
    return rows


def curve(report: dict, arm: str, recipe: str, lr: float, J: int | None, k: int, steps: int) -> list | None:
    """The first seed's validation curve of one run of the report, None when it has none."""
    run = run_of(report, arm, recipe, lr, J, k, steps)
    return (run["val_curve"] or None) if run is not None else None


def plot(reports: list[dict], rows: list[dict], path: str) -> None:
    """A panel per depth: backprop's best, and the shipped and best recipes at each measured k."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({r["J"] for r in rows})
    fig, axes = plt.subplots(1, len(depths), figsize=(5 * len(depths), 4), squeeze=False)
    for ax, J in zip(axes[0], depths):
        mine = [r for r in rows if r["J"] == J]
        report = next(rep for rep in reports if rep["source"] == mine[0]["source"])
        b = mine[0]["backprop_best"]
        lines = [("backprop " + b["optimizer"], curve(report, "backprop", b["optimizer"], b["lr"], None,
                                                      report["args"]["backprop_k"], mine[0]["steps"]), "black")]
        for r in mine:
            best = next(x for x in report["best"] if (x["J"], x["k"], x["steps"], x["recipe"])
                        == (J, r["k"], r["steps"], r["best_recipe"]))
            lines.append((f"{r['best_recipe']} k={r['k']}", curve(report, "petra", r["best_recipe"], best["lr"], J,
                                                                   r["k"], r["steps"]), None))
        for label, points, color in lines:
            if points:
                x, y = zip(*points)
                ax.plot(x, y, marker=".", color=color, label=label)
        loss_panel(ax, f"J = {J} ({mine[0]['blocks']} blocks, d {mine[0]['d_model']})")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", nargs="+", required=True, help="accuracy lm reports (JSON), one per model")
    parser.add_argument("--output", default="runs/lm_accuracy/depth.json")
    args = parser.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(os.path.join(ROOT, path)) as f:
            reports.append({**json.load(f), "source": path})
    rows = [row for report in reports for row in depth_rows(report)]
    if not rows:
        raise SystemExit("the reports hold no PETRA run: run `python -m benchmarks.accuracy lm` first")
    save_report(args.output, {"rows": rows, "reports": args.reports})
    plot(reports, rows, os.path.join(ROOT, os.path.splitext(args.output)[0] + ".png"))
    print(f"{'J':>3s} {'blocks':>6s} {'k':>4s} {'steps':>5s} {'shipped vs same optimizer':>26s} "
          f"{'best recipe':>16s} {'vs best backprop':>17s}")
    for r in rows:
        shipped = "-" if r["shipped_gap"] is None else f"{100 * r['shipped_gap']:+.2f}% ({r['shipped_seeds']} seeds)"
        print(f"{r['J']:3d} {r['blocks']:6d} {r['k']:4d} {r['steps']:5d} {shipped:>26s} {r['best_recipe']:>16s} "
              f"{100 * r['best_gap']:+15.2f}% ({r['best_seeds']} seeds)")

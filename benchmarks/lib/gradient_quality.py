"""How close is PETRA's gradient to the delayed and to the end-to-end gradient, per stage, early and
late in training (the paper's App. B, Fig. 5 / Fig. 6), on a small RevNet (digits) and a RevGPT.

    OMP_NUM_THREADS=1 python -m benchmarks.accuracy gradient-quality --model revnet   # RevNet18 w16, digits, J=10
    OMP_NUM_THREADS=1 python -m benchmarks.accuracy gradient-quality --model revgpt   # RevGPT, stdlib text, J=4

Runs the example with ``--gradient-quality N`` under the deepspeed launcher (PETRA config), reads the
per-stage rows it logged to metrics.jsonl, prints per-stage means over the first, the middle and the
last tenth of the followed micro-batches and saves them as JSON, with the plot, under runs/benchmarks/
(``--output-dir benchmarks/results`` regenerates the committed ones).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from petra_ds.diagnostics.gradient_quality import by_stage, plot

from .example_runs import DEEPSPEED, ROOT, run_example, save_report
from .lm_accuracy import stdlib_corpus

COLUMNS = ("cos_petra_delayed", "cos_petra_e2e", "cos_delayed_e2e", "norm_petra_e2e", "reconstruction_error")


def command(args: argparse.Namespace, out: str) -> list[str]:
    if args.model == "revnet":
        return [DEEPSPEED, "--num_gpus", str(args.procs), "examples/revnet/train.py",
                "--deepspeed_config", "ds_configs/petra_digits.json", "--dataset", "digits", "--arch", "revnet18",
                "--width", "16", "--epochs", str(args.epochs), "--seed", str(args.seed), "--workers", "1",
                "--gradient-quality", str(args.every), "--output-dir", out,
                "--delay-compensation", args.delay_compensation]
    files = stdlib_corpus(os.path.join(ROOT, args.run_dir, "text"), 3_000_000)
    return [DEEPSPEED, "--num_gpus", str(args.procs), "examples/reformer/train.py",
            "--deepspeed_config", "ds_configs/petra_lm.json", "--model", "revgpt", "--data-files", *files,
            "--seq-len", "128", "--d-model", "128", "--layers", "6", "--heads", "4", "--vocab-size", "2048",
            "--lr", "2e-4", "--max-steps", str(args.steps), "--eval-every", str(max(1, args.steps // 4)),
            "--stages", "4", "--seed", str(args.seed), "--gradient-quality", str(args.every), "--output-dir", out,
            "--delay-compensation", args.delay_compensation]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["revnet", "revgpt"], default="revnet")
    parser.add_argument("--every", type=int, default=10, help="optimizer steps between two followed micro-batches")
    parser.add_argument("--epochs", type=int, default=40, help="revnet")
    parser.add_argument("--steps", type=int, default=480, help="revgpt: train_batch calls")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default="runs/gradient_quality")
    parser.add_argument("--delay-compensation", default="none",
                        help="PETRA's delay compensation (petra_ds.runtime.compensation): none, weight_prediction, lr_rescale")
    parser.add_argument("--output-dir", default=os.path.join("runs", "benchmarks"),
                        help="where the JSON report and the PNG go (relative to the repository root)")
    parser.add_argument("--rows-from", default=None, help="recompute the tables from this saved report (no run)")
    args = parser.parse_args(argv)

    name = args.model + ("" if args.delay_compensation == "none" else f"_{args.delay_compensation}")
    output = os.path.join(args.output_dir, f"gradient_quality_{name}.json")
    if args.rows_from:  # the tables again from a saved report, without training
        with open(os.path.join(ROOT, args.rows_from)) as f:
            report = json.load(f)
        rows = report["rows"]
    else:
        out = os.path.join(args.run_dir, name)
        cmd = command(args, out)
        summary, rows, wall = run_example(cmd, out)
        rows = [r for r in rows if r.get("kind") == "gradient_quality"]
        report = {"model": args.model, "args": vars(args), "command": " ".join(cmd[1:]), "wall_s": wall,
                  "summary": summary, "rows": rows}
        figure = os.path.join(ROOT, args.output_dir, f"gradient_quality_{name}.png")
        os.makedirs(os.path.dirname(figure), exist_ok=True)
        shutil.copy(plot(rows, os.path.join(ROOT, out, "gq_plot.png"), title=f"{name}: PETRA gradient quality"),
                    figure)
    steps = sorted({r["step"] for r in rows})
    tenth = max(1, len(steps) // 10)
    middle = len(steps) // 2
    spans = {"early": steps[:tenth], "middle": steps[middle:middle + tenth], "late": steps[-tenth:]}
    for part, span in spans.items():
        report[f"{part}_steps"] = [span[0], span[-1]]
        report[part] = by_stage(rows, span[0], span[-1])
    save_report(output, report)
    for part in spans:
        table, span = report[part], report[f"{part}_steps"]
        print(f"\n{part} (optimizer steps {span[0]}-{span[1]}):")
        print(f"{'stage':>5s} " + " ".join(f"{c:>20s}" for c in COLUMNS))
        for r in table:
            print(f"{r['stage']:5d} " + " ".join(f"{r[c]:20.4g}" for c in COLUMNS))
    print(f"\nplot: {os.path.join(args.output_dir, f'gradient_quality_{name}.png')}")


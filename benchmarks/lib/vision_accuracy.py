"""PETRA (plain and with each delay compensation) vs backprop (DeepSpeed 1F1B) on the same
architecture, data, epochs and seed.

    OMP_NUM_THREADS=1 python -m benchmarks.accuracy --dataset digits --width 16 --epochs 40 --procs 2
    ... --methods backprop petra weight_prediction lr_rescale --procs 1 --jobs 2 --epochs 15
    ... --arch revnet34 --width 8 --epochs 30 --procs 1 --global-batch 64 --micro-batches 8     # J = 18

Runs examples/revnet/train.py once per method (under the deepspeed launcher with --procs > 1; --jobs
runs at once, one thread each), prints the final and best eval accuracies and each other method's difference
to PETRA in points (any subset of methods; a PETRA-only run has no difference), and saves everything as JSON.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor

from .example_runs import METHODS, launcher, method_arguments, run_example, save_report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--arch", default="revnet18")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--methods", nargs="+", default=["backprop", "petra"], choices=METHODS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=None, metavar="N",
                        help="samples per optimizer step, for every method (default: each config's own)")
    parser.add_argument("--micro-batches", type=int, default=None, metavar="K",
                        help="split --global-batch into K micro-batches, for every method (default: the example "
                             "chooses, for PETRA the fewest that keep stage 0 one optimizer step behind)")
    parser.add_argument("--petra-config", default="ds_configs/petra_digits.json")
    parser.add_argument("--backprop-config", default="ds_configs/backprop_digits.json")
    parser.add_argument("--output", default="runs/benchmarks/accuracy_digits.json",
                        help="JSON report, relative to the repository root")
    parser.add_argument("--run-dir", default="runs/accuracy")
    args = parser.parse_args(argv)

    def run(method: str) -> tuple[str, dict]:
        out = os.path.join(args.run_dir, method)
        config = args.backprop_config if method == "backprop" else args.petra_config
        cmd = launcher(args.procs) + [
            "examples/revnet/train.py", "--deepspeed_config", config, "--dataset", args.dataset, "--arch", args.arch,
            "--width", str(args.width), "--epochs", str(args.epochs), "--seed", str(args.seed), "--workers", "1",
            "--output-dir", out] + method_arguments(method)
        for flag, value in (("--global-batch", args.global_batch), ("--micro-batches", args.micro_batches)):
            if value is not None:
                cmd += [flag, str(value)]
        summary, _rows, wall = run_example(cmd, out)
        return method, {"final_eval_acc": summary["final_eval_acc"], "best_eval_acc": summary["best_eval_acc"],
                        "samples_per_s": summary["samples_per_s"], "stages": summary["stages"],
                        "wall_s": wall, "command": " ".join(cmd[1:])}

    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(run, args.methods))
    # every other method against PETRA, in points of final accuracy (none without a PETRA run)
    gaps = {f"{m} - petra": 100 * (r["final_eval_acc"] - results["petra"]["final_eval_acc"])
            for m, r in results.items() if m != "petra" and "petra" in results}
    report = {"dataset": args.dataset, "arch": args.arch, "width": args.width, "epochs": args.epochs,
              "procs": args.procs, "seed": args.seed, "global_batch": args.global_batch,
              "micro_batches": args.micro_batches, "results": results,
              "gap_points_final": gaps.get("backprop - petra"), "gaps_points_final": gaps}
    save_report(args.output, report)
    print(f"{'method':18s} {'final':>8s} {'best':>8s} {'samples/s':>10s} {'wall s':>8s}")
    for method, r in results.items():
        print(f"{method:18s} {100 * r['final_eval_acc']:7.2f}% {100 * r['best_eval_acc']:7.2f}% "
              f"{r['samples_per_s']:10.1f} {r['wall_s']:8.1f}")
    for name, gap in gaps.items():
        print(f"{name} (final): {gap:+.2f} points")


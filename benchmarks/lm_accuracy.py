"""PETRA (plain and with each delay compensation) against backprop on the same RevGPT, text, steps and
seed, over a grid of Adam learning rates and pipeline depths J, on CPU.

    OMP_NUM_THREADS=1 python benchmarks/lm_accuracy.py --lrs 2e-4 5e-4 1e-3 --stages 4 8 --steps 320 --jobs 2

The text is offline and reproducible: the docstrings of this Python's standard library, one paragraph
per line, the last 5% of paragraphs held out. Every run is examples/reformer/train.py (AdamW, warm-up
then cosine decay, dropout 0.1, k = 4); backprop is DeepSpeed's engine (1F1B with --procs > 1; with
--procs 1 a single stage: the same arithmetic), PETRA runs its J stages on --procs processes (the stages
per process do not change PETRA's arithmetic: tests/test_engine.py::test_layout_invariance). A run
whose summary.json exists is read back instead of run again, so a sweep can be continued. Prints the
table of final validation losses and gaps to backprop, saves the JSON and one PNG of all the curves.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from example_runs import METHODS, ROOT, launcher, method_arguments, read_run, run_example, save_report


def stdlib_corpus(out_dir: str, max_chars: int) -> list[str]:
    """train.txt and valid.txt from the standard library's docstrings; returns their paths."""
    paragraphs = []
    root = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if rel.startswith(("test", "site-packages", "idlelib")) or "/test" in rel:
            continue
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    paragraphs += [" ".join(p.split()) for p in doc.split("\n\n") if len(p.split()) >= 4]
        if sum(map(len, paragraphs)) > max_chars:
            break
    split = int(0.95 * len(paragraphs))
    os.makedirs(out_dir, exist_ok=True)
    files = [os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "valid.txt")]
    for path, part in zip(files, (paragraphs[:split], paragraphs[split:])):
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(part) + "\n")
    return files


def command(args: argparse.Namespace, files: list[str], method: str, lr: float, stages: int, out: str) -> list[str]:
    config = args.backprop_config if method == "backprop" else args.petra_config
    cmd = launcher(args.procs) + [
        "examples/reformer/train.py", "--deepspeed_config", config, "--model", "revgpt", "--data-files", *files,
        "--seq-len", str(args.seq_len), "--d-model", str(args.d_model), "--layers", str(args.layers),
        "--heads", str(args.heads), "--vocab-size", str(args.vocab_size), "--lr", str(lr),
        "--warmup-steps", str(args.warmup_steps), "--max-steps", str(args.steps),
        "--eval-every", str(max(1, args.steps // 8)), "--eval-batches", str(args.eval_batches),
        "--seed", str(args.seed), "--output-dir", out]
    if method != "backprop":
        cmd += ["--stages", str(stages)]
    return cmd + method_arguments(method)


def run_one(args: argparse.Namespace, files: list[str], method: str, lr: float, stages: int) -> dict:
    name = f"{method}_lr{lr:g}" + ("" if method == "backprop" else f"_J{stages}")
    out = os.path.join(args.run_dir, name)
    cmd = command(args, files, method, lr, stages, out)
    if os.path.exists(os.path.join(ROOT, out, "summary.json")):
        (summary, rows), wall = read_run(out), None
    else:
        summary, rows, wall = run_example(cmd, out)
    print(f"{name}: {summary['final_val_loss']:.4f}", flush=True)
    return {"method": method, "lr": lr, "stages": None if method == "backprop" else stages,
            "final_val_loss": summary["final_val_loss"], "val_curve": [(r["step"], r["val_loss"]) for r in rows],
            "wall_s": wall, "command": " ".join(cmd[1:] if args.procs > 1 else ["python"] + cmd[1:])}


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs, depths = report["args"]["lrs"], report["args"]["stages"]
    fig, axes = plt.subplots(len(depths), len(lrs), figsize=(4.2 * len(lrs), 3.4 * len(depths)), squeeze=False)
    for row, J in enumerate(depths):
        for col, lr in enumerate(lrs):
            ax = axes[row][col]
            for r in report["runs"]:
                if r["lr"] == lr and r["stages"] in (None, J):
                    steps, losses = zip(*r["val_curve"])
                    ax.plot(steps, losses, marker=".", label=r["method"],
                            color="black" if r["method"] == "backprop" else None)
            ax.set_title(f"Adam lr {lr:g}, J = {J}")
            ax.set_xlabel("train_batch calls")
            ax.set_ylabel("validation loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", type=float, nargs="+", default=[2e-4, 5e-4, 1e-3])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8], help="PETRA depths J")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--warmup-steps", type=int, default=32)
    parser.add_argument("--procs", type=int, default=1, help="processes per run")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--eval-batches", type=int, default=50)
    parser.add_argument("--max-chars", type=int, default=3_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--petra-config", default="ds_configs/petra_lm.json")
    parser.add_argument("--backprop-config", default="ds_configs/backprop_lm.json")
    parser.add_argument("--output", default="benchmarks/results/lm_accuracy.json")
    parser.add_argument("--run-dir", default="runs/lm_accuracy")
    args = parser.parse_args()

    files = stdlib_corpus(os.path.join(ROOT, args.run_dir, "text"), args.max_chars)
    jobs = [(m, lr, J) for lr in args.lrs for m in args.methods for J in (args.stages[:1] if m == "backprop"
                                                                          else args.stages)]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda job: run_one(args, files, *job), jobs))
    backprop = {r["lr"]: r["final_val_loss"] for r in runs if r["method"] == "backprop"}
    for r in runs:
        if r["lr"] in backprop:
            r["gap_to_backprop"] = (r["final_val_loss"] - backprop[r["lr"]]) / backprop[r["lr"]]
    report = {"model": "revgpt", "args": vars(args), "runs": runs}
    save_report(args.output, report)
    plot(report, os.path.join(ROOT, os.path.splitext(args.output)[0] + ".png"))
    print(f"{'lr':>7s} {'J':>3s} {'method':18s} {'val loss':>9s} {'vs backprop':>12s}")
    for r in sorted(runs, key=lambda r: (r["lr"], r["stages"] or 0, METHODS.index(r["method"]))):
        gap = r.get("gap_to_backprop")
        print(f"{r['lr']:7.0e} {r['stages'] or '-':>3} {r['method']:18s} {r['final_val_loss']:9.4f} "
              f"{'' if gap is None else f'{100 * gap:+.2f}%':>12s}")


if __name__ == "__main__":
    main()

"""PETRA vs backprop (DeepSpeed 1F1B) on the same small RevGPT, text, steps and seed, on CPU.

    OMP_NUM_THREADS=1 python benchmarks/lm_accuracy.py --steps 480 --procs 2

The text is offline and reproducible: the docstrings of this Python's standard library, one paragraph
per line, the last 5% of paragraphs held out. Runs examples/reformer/train.py once per method under
the deepspeed launcher (a BPE tokenizer trained on the training text), prints the final validation
losses and their relative gap, and saves everything as JSON.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import sysconfig

from example_runs import DEEPSPEED, ROOT, run_example, save_report


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--stages", type=int, default=4, help="PETRA stages J")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-chars", type=int, default=3_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--petra-config", default="ds_configs/petra_lm.json")
    parser.add_argument("--backprop-config", default="ds_configs/backprop_lm.json")
    parser.add_argument("--output", default="benchmarks/results/lm_accuracy.json")
    parser.add_argument("--run-dir", default="runs/lm_accuracy")
    args = parser.parse_args()

    files = stdlib_corpus(os.path.join(ROOT, args.run_dir, "text"), args.max_chars)
    results = {}
    for method, config in (("petra", args.petra_config), ("backprop", args.backprop_config)):
        out = os.path.join(args.run_dir, method)
        cmd = [DEEPSPEED, "--num_gpus", str(args.procs), "examples/reformer/train.py", "--deepspeed_config", config,
               "--model", "revgpt", "--data-files", *files, "--seq-len", str(args.seq_len),
               "--d-model", str(args.d_model), "--layers", str(args.layers), "--heads", str(args.heads),
               "--vocab-size", str(args.vocab_size), "--lr", str(args.lr), "--max-steps", str(args.steps),
               "--eval-every", str(max(1, args.steps // 10)), "--seed", str(args.seed), "--output-dir", out]
        if method == "petra":
            cmd += ["--stages", str(args.stages)]
        summary, curve, wall = run_example(cmd, out)
        results[method] = {"final_val_loss": summary["final_val_loss"],
                           "final_val_perplexity": summary["final_val_perplexity"],
                           "tokens_per_s": summary["tokens_per_s"], "stages": summary["stages"],
                           "val_curve": [(m["step"], m["val_loss"]) for m in curve],
                           "wall_s": wall, "command": " ".join(cmd[1:])}
    petra, backprop = results["petra"]["final_val_loss"], results["backprop"]["final_val_loss"]
    gap = (petra - backprop) / backprop
    report = {"model": "revgpt", "steps": args.steps, "procs": args.procs, "seed": args.seed,
              "args": vars(args), "results": results, "relative_gap_val_loss": gap}
    save_report(args.output, report)
    print(f"{'method':10s} {'val loss':>9s} {'ppl':>8s} {'tokens/s':>9s} {'wall s':>8s}")
    for method, r in results.items():
        print(f"{method:10s} {r['final_val_loss']:9.4f} {r['final_val_perplexity']:8.2f} "
              f"{r['tokens_per_s']:9.1f} {r['wall_s']:8.1f}")
    print(f"(petra - backprop) / backprop: {100 * gap:+.2f}% of the validation loss")


if __name__ == "__main__":
    main()

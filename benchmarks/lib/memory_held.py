"""Per-stage memory held across clocks: PETRA vs its two delayed-gradient ablations vs DeepSpeed's 1F1B.

    OMP_NUM_THREADS=1 python -m benchmarks.memory --J 2 4 8

For each J the same RevGPT (``--layers-per-stage`` layers per stage: stage 0 = embedding + block, middle
stages = reversible blocks only, last = final norm + LM head, so a stage's content does not change with
J) trains ``--train-batches`` x k micro-batches (k = J unless ``--k``) on J processes, one stage each, with

- ``petra``: PETRA (reversible stages reconstruct their input, no weight stash);
- ``delayed_ckpt``: ``"input_buffer": "all"``, delayed gradients + checkpointing (Xu et al., Kosson et al.);
- ``delayed_stash``: ``"input_buffer": "all", "param_buffer": true``, standard delayed gradients (PipeDream);
- ``1f1b``: DeepSpeed's own PipelineEngine (TrainSchedule) on the same layers, k micro-batches per step.

At the end of every PETRA clock and after every step of DeepSpeed's schedule each stage measures what it
holds for training in flight (``petra_ds.diagnostics.held``): tensors autograd saved for a later backward
plus the engine's buffers, distinct storages only, parameters excluded. "activations" = graph + kept
inputs + kept outputs; "held" adds the data micro-batches, the parameter stash and the messages. The
unit "mb" is 1F1B's activations at that stage right after its first forward, when exactly one
micro-batch is in flight there: one micro-batch's activations under backprop. The graph's high-water
mark at any instant (inside clocks too: the graph a reconstruction builds and frees within its clock) is
reported beside it, from a running total the saved-tensor hooks keep. On a GPU (one per process,
``--device cuda``) each rank also reports ``torch.cuda.max_memory_allocated`` minus the model + optimizer
baseline; on CPU that field says it was not run. Writes ``runs/benchmarks/memory_<device>.json`` and
``.png`` (``--output`` to choose: ``--output benchmarks/results/memory_cpu.json`` regenerates the committed
one) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from typing import Any, Sequence

import torch

from petra_ds.diagnostics.held import CATEGORIES
from petra_ds.util.files import save_figure, write_text_atomic

from .example_runs import ROOT
from .memory_worker import METHODS, launch

LABELS = {"petra": "PETRA", "delayed_ckpt": "delayed grad. + checkpointing (input buffer)",
          "delayed_stash": "delayed grad., PipeDream (input + param buffers)", "1f1b": "1F1B backprop (DeepSpeed)"}


def spec_for(args: argparse.Namespace, J: int) -> dict[str, Any]:
    spec = {"J": J, "k": args.k or J, "micro_batch": args.micro_batch, "train_batches": args.train_batches,
            "layers_per_stage": args.layers_per_stage, "vocab_size": args.vocab_size, "seq_len": args.seq_len,
            "d_model": args.d_model, "n_heads": args.heads, "mlp_ratio": 4, "dropout": args.dropout,
            "methods": list(METHODS), "seed": args.seed, "trace": True}
    if args.device == "cpu":  # DeepSpeed's CPU accelerator, gloo, even where a GPU is visible
        spec["env"] = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    else:
        spec["backend"] = "nccl"
    return spec


def summarize(J: int, k: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per (method, stage): peaks by category, and the activation peak in units of one
    micro-batch's activations at that stage (1F1B's after its first forward there)."""
    units = [r["1f1b"]["first_activations"] if "1f1b" in r else None for r in results]
    methods: dict[str, list[dict[str, Any]]] = {}
    for method in METHODS:
        rows = []
        for j, rank in enumerate(results):
            if method not in rank:
                continue
            r = rank[method]
            unit = units[j]
            rows.append({
                "stage": j, "layers": r["layers"], "reconstructs": r["reconstructs"],
                "activations_peak": r["peak"]["activations"], "held_peak": r["peak_held"],
                "peak": r["peak"], "activations_peak_mb": r["peak"]["activations"] / unit if unit else None,
                "graph_transient_peak": r["peak"]["graph_transient"],
                "graph_transient_peak_mb": r["peak"]["graph_transient"] / unit if unit else None,
                "in_flight_peak": r.get("peak_in_flight"), "param_bytes": r["param_bytes"],
                "ledger_mismatches": len(r.get("ledger_mismatches", [])), "ledger_peaks": r.get("ledger_peaks"),
                "observations": r["steps"], "cuda_peak_minus_baseline": r["cuda_peak_minus_baseline"],
                "allocated": r.get("allocated"),
                "trace": r.get("trace"),
            })
        methods[method] = rows
    return {"J": J, "k": k, "unit_one_micro_batch": units, "methods": methods}


def _kib(n: int) -> str:
    return f"{n / 1024:9.1f}"


def table(summary: dict[str, Any]) -> str:
    """Per stage and method: peak activations in KiB and micro-batch units, peak of everything held."""
    lines = [f"J = {summary['J']}, k = {summary['k']}: peak over the run, KiB (activations in units of one "
             "micro-batch's activations at that stage)"]
    head = f"{'stage':>5s} {'layers':28s} {'unit KiB':>9s}"
    for method in METHODS:
        head += f" | {method:>24s}"
    lines += [head, f"{'':>5s} {'':28s} {'':>9s}" + " | {:>9s} {:>5s} {:>8s}".format("act", "mb", "held") * 4]
    for j, unit in enumerate(summary["unit_one_micro_batch"]):
        row0 = summary["methods"]["1f1b"][j] if summary["methods"].get("1f1b") else summary["methods"]["petra"][j]
        line = f"{j:5d} {'+'.join(row0['layers'])[:28]:28s} {_kib(unit or 0)}"
        for method in METHODS:
            r = summary["methods"][method][j]
            mb = f"{r['activations_peak_mb']:5.2f}" if r["activations_peak_mb"] is not None else "   - "
            line += f" | {_kib(r['activations_peak'])} {mb} {r['held_peak'] / 1024:8.1f}"
        lines.append(line)
    lines.append("graph high-water mark at any instant, inside clocks too (saved tensors only), KiB (mb):")
    for j in range(len(summary["unit_one_micro_batch"])):
        cells = []
        for method in METHODS:
            r = summary["methods"][method][j]
            mb = r["graph_transient_peak_mb"]
            cells.append(f"{method} {r['graph_transient_peak'] / 1024:.1f}" + (f" ({mb:.2f})" if mb is not None else ""))
        lines.append(f"{j:5d}   " + ", ".join(cells))
    return "\n".join(lines)


def growth(summaries: list[dict[str, Any]], stage: int, key: str = "activations_peak_mb") -> str:
    """One stage's peak across J, one line per method."""
    shown = [s for s in summaries if stage < s["J"] - 1 or stage == 0]
    unit = "micro-batches" if key.endswith("_mb") else "KiB"
    lines = [f"stage {stage}, {key} ({unit}):".ljust(40) + " ".join(f"{'J=' + str(s['J']):>6s}" for s in shown)]
    for method in METHODS:
        values = []
        for s in shown:
            v = s["methods"][method][stage][key]
            values.append(f"{v:6.2f}" if key.endswith("_mb") else f"{v / 1024:6.0f}")
        lines.append(f"  {method:37s} " + " ".join(values))
    return "\n".join(lines)


def plot(summaries: list[dict[str, Any]], path: str, title: str) -> str:
    """Peak bytes held per stage vs J: stage 0 and stage 1 (the reversible stage with the longest delay),
    activations on top, everything held below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    styles = {"petra": dict(color="tab:green", marker="o", linewidth=5, alpha=0.5, markersize=9),
              "delayed_ckpt": dict(color="tab:orange", marker="s", linestyle="--"),
              "delayed_stash": dict(color="tab:red", marker="^", linestyle=":"),
              "1f1b": dict(color="tab:blue", marker="D")}  # PETRA drawn wide: the ablations overlap it at stage 0
    for col, stage in enumerate((0, 1)):
        for row, key in enumerate(("activations_peak", "held_peak")):
            ax = axes[row][col]
            for method in METHODS:
                points = [(s["J"], s["methods"][method][stage][key] / 1024) for s in summaries
                          if stage == 0 or stage < s["J"] - 1]
                if points:
                    ax.plot(*zip(*points), label=LABELS[method], **styles[method])
            name = "stage 0 (embedding + block)" if stage == 0 else "stage 1 (2 reversible blocks)"
            what = "activations" if key == "activations_peak" else "everything held"
            ax.set_title(f"{name}: {what}", fontsize=10)
            ax.set_ylabel("peak KiB held at a clock end" if row == 0 else
                          "peak KiB held (+ data, param stash, messages)")
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel("J (pipeline stages = processes)")
            ax.set_xticks([s["J"] for s in summaries])
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def dumps(report: dict[str, Any]) -> str:
    """Indented JSON with every list of numbers (the traces) on one line."""
    text = json.dumps(report, indent=1)
    return re.sub(r"\[[\d\s,.\-]*\]", lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "), text)


def machine() -> dict[str, Any]:
    import deepspeed

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--J", type=int, nargs="+", default=[2, 4, 8], help="pipeline stages (processes)")
    parser.add_argument("--k", type=int, default=None, help="gradient accumulation steps (default: J)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--train-batches", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda when there is a GPU per process, else cpu")
    parser.add_argument("--output", default=None, help="JSON report, relative to the repository root "
                        "(default runs/benchmarks/memory_<device>.json); the PNG goes beside it")
    args = parser.parse_args(argv)
    if args.k is not None and args.k < max(args.J):
        print(f"note: k = {args.k} < J: 1F1B does not reach its steady state at the larger J")
    command = "OMP_NUM_THREADS=1 python -m benchmarks.memory " + " ".join(sys.argv[1:] if argv is None else argv)
    report: dict[str, Any] = {"command": command,
                              "machine": machine(), "args": vars(args), "categories": list(CATEGORIES),
                              "runs": []}
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.device_count() >= max(args.J) else "cpu"
    device = args.device
    for J in args.J:
        start = time.time()
        results = launch(spec_for(args, J))
        summary = summarize(J, args.k or J, results)
        summary["wall_s"] = round(time.time() - start, 1)
        report["runs"].append(summary)
        print(table(summary), f"\n({summary['wall_s']} s)\n", flush=True)
    summaries = report["runs"]
    for stage in (0, 1):
        print(growth(summaries, stage, "activations_peak"))
        print(growth(summaries, stage, "activations_peak_mb"))
        print(growth(summaries, stage, "held_peak"))
        print(growth(summaries, stage, "graph_transient_peak_mb"))
    output = args.output or os.path.join("runs", "benchmarks", f"memory_{device}.json")
    path = os.path.join(ROOT, output) if not os.path.isabs(output) else output
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text_atomic(path, dumps(report))
    figure = plot(summaries, os.path.splitext(path)[0] + ".png",
                  f"RevGPT d={args.d_model}, T={args.seq_len}, micro-batch {args.micro_batch}, "
                  f"{args.layers_per_stage} layers/stage, fp32, {device}: bytes held across clocks per stage")
    print(f"\nwrote {path} and {figure}")
    return report

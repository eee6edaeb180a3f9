"""Per-rank peak memory in the paper's multi-GPU settings, one stage per GPU: PETRA with and without
``fifo_offload`` against DeepSpeed's 1F1B (``petra_ds.diagnostics.rank_memory``: per-stage bytes measured on the real
layers, one micro-batch at a time, on this machine; per-rank peaks computed from them).

    python -m benchmarks.memory ranks

RevNet18 on CIFAR-10 (32 x 32, micro-batch 128) on 10 GPUs, RevNet34 and RevNet50 on ImageNet (224 x 224,
micro-batch 64) on 18, fp32, the paper's SGD with momentum. Writes runs/benchmarks/memory_ranks_<device>.json.
"""

from __future__ import annotations

import argparse

import torch

from petra_ds.diagnostics import rank_memory

from . import throughput
from .example_runs import save_report

#: (depth, image side, micro-batch): the paper's settings
SETTINGS = ((18, 32, 128), (34, 224, 64), (50, 224, 64))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int, nargs="+", default=[d for d, _, _ in SETTINGS], choices=[18, 34, 50])
    p.add_argument("--base-width", type=int, default=64, help="64: the paper's networks")
    p.add_argument("--micro-batch-scale", type=float, default=1.0, help="a fraction of the paper's micro-batch")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    command = "python -m benchmarks.memory ranks " + " ".join(argv or [])
    reports = []
    for depth, image, micro_batch in SETTINGS:
        if depth in args.depths:
            report = rank_memory.revnet_report(depth, image, max(1, round(micro_batch * args.micro_batch_scale)),
                                               args.base_width)
            rank_memory.print_report(report)
            reports.append(report)
    out = {"command": command.strip(), "device": throughput.device_name(), "torch": torch.__version__,
           "reports": reports}
    path = save_report(args.output or "runs/benchmarks/memory_ranks_cpu.json", out)
    print(f"wrote {path}")
    return out

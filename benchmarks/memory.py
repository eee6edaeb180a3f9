"""Memory at a budget: how much does PETRA hold, and under a per-rank memory cap which schedule trains fastest?

    python -m benchmarks.memory [flags]             held per stage (default)
    python -m benchmarks.memory capped [flags]
    python -m benchmarks.memory growth [flags]
    python -m benchmarks.memory ranks [flags]

- held per stage (default): the bytes each stage holds across clocks for PETRA, its two delayed-gradient
  ablations and DeepSpeed's 1F1B, against the pipeline depth J. Writes runs/benchmarks/memory_<device>.json and a
  PNG. 2 cores: about 2 min (report: benchmarks/results/memory_cpu.json).
- capped: under a cap at PETRA's own peak, each schedule's fastest configuration that fits (micro-batch size, k,
  partition, grain), and PETRA against the fastest peer that fits. Writes
  runs/benchmarks/memory_capped_<model>_<device>.json. 2 cores: about 45 min (estimate from the run behind
  benchmarks/results/memory_capped_revgpt_grain_cpu.json); a tiny search 97 s (measured).
- growth: how each schedule's per-rank peak grows with J and the sequence length, and a memory model fitted to it
  that predicts deeper pipelines. Writes runs/benchmarks/memory_growth_<device>.json and a PNG. 2 cores: 40 min
  (report: benchmarks/results/memory_growth_cpu.json); ``--from-report`` 9 s (measured).
- ranks: per-rank peaks in the paper's multi-GPU settings (RevNet18 on 10 GPUs, RevNet34/50 on 18), PETRA with and
  without ``fifo_offload`` against 1F1B, computed from per-stage bytes measured on the real layers. Writes
  runs/benchmarks/memory_ranks_cpu.json. 2 cores: 3.5 min (measured; report: benchmarks/results/memory_ranks_cpu.json).

Durations are for the default flags; docs/benchmarks.md has their sources. ``<word> --help`` lists a
sub-benchmark's flags. Set OMP_NUM_THREADS=1 on a CPU.
"""

from __future__ import annotations

from typing import Any, Sequence

from .lib import memory_capped, memory_growth, memory_held, memory_ranks
from .lib.commands import dispatch

COMMANDS = {"capped": memory_capped.main, "growth": memory_growth.main, "ranks": memory_ranks.main}


def main(argv: Sequence[str] | None = None) -> Any:
    return dispatch("benchmarks.memory", __doc__, memory_held.main, COMMANDS, argv)


if __name__ == "__main__":
    main()

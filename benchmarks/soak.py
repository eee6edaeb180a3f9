"""Soak: does PETRA keep working under load? A 2-process, J = 4 RevGPT trains for thousands of clocks with a
checkpoint every 50 steps; after the warm-up the engine's holdings and the resident memory must stop growing, and
no stage may hold more messages than the schedule allows.

    python -m benchmarks.soak [flags]
    python -m benchmarks.soak checkpoint [flags]   # how long training waits for a checkpoint, sync against async

Writes runs/benchmarks/soak_cpu.json and a PNG. 2 cores, default flags: 2.5 min (measured: tests/test_soak.py
runs the same 500 steps).
"""

from __future__ import annotations

from typing import Any, Sequence

from .lib import checkpoint_stall, soak
from .lib.commands import dispatch


def main(argv: Sequence[str] | None = None) -> Any:
    return dispatch("benchmarks.soak", __doc__, soak.main, {"checkpoint": checkpoint_stall.main}, argv)


if __name__ == "__main__":
    main()

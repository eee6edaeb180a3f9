"""Speed against peers: is PETRA faster than the pipeline schedules a user could pick instead?

    python -m benchmarks.peers [flags]                  throughput (default)
    python -m benchmarks.peers grain [flags]
    python -m benchmarks.peers split-backward [flags]

- throughput (default): samples/s and peak memory of PETRA, plain backprop in one process, DeepSpeed's pipeline
  (naive, 1F1B, 1F1B checkpointed) and torch.distributed.pipelining's schedules (1F1B, interleaved, zero-bubble,
  ZBV, DualPipeV, each also checkpointed) on the same layers and processes. Writes
  runs/benchmarks/throughput_<model>_<device>.json. 2 cores: about 10 min (estimate from a measured tiny run,
  about 22 s of start-up per variant, and the committed per-call times).
- grain: do RevGPT's blocks cut into attention and MLP halves give PETRA a better balanced clock? From layer costs
  measured in this process. Writes runs/benchmarks/partition_grain.json. 2 cores: about 1 min (estimate from the
  committed layer costs); a tiny run 6 s (measured).
- split-backward: why do torch's zero-bubble schedules hold as much with activation checkpointing as without it?
  Writes runs/benchmarks/ckpt_split_backward.json. 2 cores: 8 s (measured).

Durations are for the default flags; docs/benchmarks.md has their sources. ``<word> --help`` lists a
sub-benchmark's flags. Set OMP_NUM_THREADS=1 on a CPU.
"""

from __future__ import annotations

from typing import Any, Sequence

from .lib import ckpt_split_backward, partition_grain, throughput
from .lib.commands import dispatch

COMMANDS = {"grain": partition_grain.main, "split-backward": ckpt_split_backward.main}


def main(argv: Sequence[str] | None = None) -> Any:
    return dispatch("benchmarks.peers", __doc__, throughput.main, COMMANDS, argv)


if __name__ == "__main__":
    main()

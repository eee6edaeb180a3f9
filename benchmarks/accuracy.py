"""Accuracy against backprop: does PETRA train as well as backprop of the same model, on images and on text?

    python -m benchmarks.accuracy [flags]                      vision (default)
    python -m benchmarks.accuracy lm [flags]
    python -m benchmarks.accuracy depth --reports R1.json R2.json ...
    python -m benchmarks.accuracy time-to-loss [flags]
    python -m benchmarks.accuracy gradient-quality [flags]

- vision (default): RevNet18 on digits, PETRA (and each delay compensation) against backprop: final and best eval
  accuracy, the gap in points. Writes runs/benchmarks/accuracy_digits.json. 2 cores: 33 min (report:
  benchmarks/results/accuracy_digits_clip1.json).
- lm: RevGPT on text, best against best: each PETRA recipe (optimizer + delay compensation) at its best learning
  rate against backprop at its best, over J and k. Writes runs/lm_accuracy/report.json and a PNG. 2 cores: about
  75 min (estimate: 24 runs of 500 steps, two at a time).
- depth: how deep can a pipeline go? The gap against J at the recommended k = 2(J-1) and at half of it, from lm
  reports (one per depth). Reads JSON only: seconds (the lm runs behind it: see docs/benchmarks.md).
- time-to-loss: how much wall time do PETRA and a backprop pipeline need to reach the loss backprop reaches at
  step N? Writes runs/benchmarks/time_to_loss_<device>.json and a PNG. 2 cores: tens of minutes (estimate from
  benchmarks/results/time_to_loss_cpu.json).
- gradient-quality: how close is PETRA's gradient to the delayed and to the end-to-end gradient, per stage (the
  paper's App. B)? Writes runs/benchmarks/gradient_quality_<model>.json and a PNG. 2 cores: 12 min (report:
  benchmarks/results/gradient_quality_revnet.json).

Durations are for the default flags; docs/benchmarks.md has their sources. ``<word> --help`` lists a
sub-benchmark's flags. Set OMP_NUM_THREADS=1 on a CPU.
"""

from __future__ import annotations

from typing import Any, Sequence

from .lib import gradient_quality, lm_accuracy, lm_depth, time_to_loss, vision_accuracy
from .lib.commands import dispatch

COMMANDS = {"lm": lm_accuracy.main, "depth": lm_depth.main, "time-to-loss": time_to_loss.main,
            "gradient-quality": gradient_quality.main}


def main(argv: Sequence[str] | None = None) -> Any:
    return dispatch("benchmarks.accuracy", __doc__, vision_accuracy.main, COMMANDS, argv)


if __name__ == "__main__":
    main()

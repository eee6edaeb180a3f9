"""GPU: on one CUDA device, how fast is PETRA against plain backprop and how much memory does it take, and what
would it reach on 8 and 10 GPUs?

    python -m benchmarks.gpu [flags]            one GPU (default)
    python -m benchmarks.gpu predict [flags]
    bash benchmarks/gpu_session.sh              every GPU check in one go

- one GPU (default): seconds per train_batch and peak memory of PETRA (all J stages in one process) against plain
  backprop of the same layers, RevNet18 and RevGPT, fp32 and bf16. Writes benchmarks/results/gpu_<device>.json.
  Needs CUDA; on 2 cores ``--device cpu --tiny`` smoke-runs every code path in 24 s (measured).
- predict: RevNet18 on 10 GPUs and RevGPT on 8, PETRA against DeepSpeed's 1F1B and torch's DualPipeV, predicted by
  the timeline model from a one-GPU report. Writes benchmarks/results/predict_gpus_<inputs>.json. 2 cores: 19 s
  (measured).
- gpu_session.sh: the GPU tests, the one-GPU benchmark and the LM example's tokens/s, logs and JSON under
  runs/gpu/. About 11 min on an H100 (its header).

docs/benchmarks.md has the durations' sources. ``<word> --help`` lists a sub-benchmark's flags.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from .lib import predict_gpus, single_gpu
from .lib.commands import dispatch

COMMANDS = {"predict": predict_gpus.main}


def main(argv: Sequence[str] | None = None) -> Any:
    return dispatch("benchmarks.gpu", __doc__, single_gpu.main, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Host overhead: what does a PETRA clock cost the host, measured without a GPU? Aten ops per micro-batch and host
syncs per train_batch against plain backprop, and host time per clock on layers of negligible cost against
DeepSpeed's and torch's pipelines.

    python -m benchmarks.host_overhead [flags]
    python -m benchmarks.host_overhead --tiny --parts ops syncs
    python -m benchmarks.host_overhead --parts instructions --output benchmarks/results/host_instructions_cpu.json

Writes benchmarks/results/host_overhead_cpu.json (``--tiny``: host_overhead_cpu_tiny.json). 2 cores, default
flags: about 2 min (report: the benchmark's own docstring); ``--tiny --parts ops syncs`` 12 s (measured);
``--parts instructions`` (host instructions per train_batch under valgrind's callgrind) 10 min (measured).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from .lib import host_overhead
from .lib.commands import dispatch


def main(argv: Sequence[str] | None = None) -> Any:
    return dispatch("benchmarks.host_overhead", __doc__, host_overhead.main, {}, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Host instructions per ``train_batch`` on layers of negligible cost, counted by valgrind's callgrind: the
``time`` part's comparison without the machine's noise. A CPU's speed moves with its neighbours, caches and
clock; the instructions a call executes do not, so one run on a busy 2-core VM gives the ratio a quiet machine
would (an instruction is not a fixed time: memory stalls differ, so the count is a proxy, measured beside time).

The benchmark runs itself again under ``valgrind --tool=callgrind`` with collection off except inside
:data:`MARK`, the C function through which ctypes enters a Python callback: each window (``calls``
``train_batch`` calls of one variant) runs as such a callback, handed to libc's ``lfind``. Callgrind dumps the
window's count when the callback returns, so the n-th dump is the n-th window. Everything before (imports,
engine construction, warm-up) and every other thread's idle spinning stays out of the counts.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Callable

from petra_ds.runtime.distributed import free_port

from .example_runs import ROOT

#: CPython's ctypes trampoline into a Python callback (libc's own symbols are not named in its debug info)
MARK = "closure_fcn"
_COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_TOTALS = re.compile(rb"^totals:\s+(\d+)", re.MULTILINE)
_SUMMARY = re.compile(rb"^summary:\s+(\d+)", re.MULTILINE)


def run_window(window: Callable[[], None]) -> None:
    """Run ``window`` inside :data:`MARK`: as the comparison of libc's linear search over one element (a plain
    call when no callgrind is watching)."""
    libc = ctypes.CDLL(None)
    libc.lfind.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
                           _COMPARE]

    def compare(_key: int, _element: int) -> int:
        window()
        return 1  # "not equal": lfind stops after its one element

    key, elements, count = ctypes.c_int(0), (ctypes.c_int * 1)(1), ctypes.c_size_t(1)
    libc.lfind(ctypes.byref(key), elements, ctypes.byref(count), ctypes.sizeof(ctypes.c_int), _COMPARE(compare))


def windows(calls: dict[str, Callable[[], None]], order: list[str], per_window: int) -> None:
    """One window of ``per_window`` calls per name of ``order``, in that order."""
    for name in order:
        def window(name: str = name) -> None:
            for _ in range(per_window):
                calls[name]()
        run_window(window)


def dump_totals(directory: str) -> list[int]:
    """The instruction count of each callgrind dump in ``directory``, in dump order (``cg.<pid>.<n>``)."""
    numbered = []
    for path in glob.glob(os.path.join(directory, "cg.*.*")):
        suffix = path.rsplit(".", 1)[1]
        if suffix.isdigit():
            with open(path, "rb") as f:
                text = f.read()
            found = _TOTALS.search(text) or _SUMMARY.search(text)
            if found is None:
                raise RuntimeError(f"{path} has no totals line: not a callgrind dump")
            numbered.append((int(suffix), int(found.group(1))))
    return [total for _, total in sorted(numbered)]


def per_call(order: list[str], totals: list[int], per_window: int) -> dict[str, list[float]]:
    """Instructions per call of each window, by variant."""
    if len(order) != len(totals):
        raise RuntimeError(f"{len(order)} windows ran but callgrind dumped {len(totals)}: something else in the "
                           f"process entered {MARK} (another ctypes callback)")
    out: dict[str, list[float]] = {}
    for name, total in zip(order, totals):
        out.setdefault(name, []).append(total / per_window)
    return out


def count(argv: list[str], rounds: int, per_window: int) -> dict[str, list[float]]:
    """Run ``python -m benchmarks.host_overhead <argv> --windows-to DIR`` under callgrind; instructions per call
    of each window, by variant."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--parts instructions counts with valgrind's callgrind, which is not on PATH: install "
                         "valgrind (apt install valgrind) or leave the part out")
    with tempfile.TemporaryDirectory(prefix="callgrind-") as directory:
        cmd = [valgrind, "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={MARK}",
               f"--dump-after={MARK}", f"--callgrind-out-file={os.path.join(directory, 'cg.%p')}",
               sys.executable, "-m", "benchmarks.host_overhead", *argv, "--windows-to", directory]
        # its own one-process world: this process's rendezvous port is taken
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"the run under callgrind failed ({done.returncode}):\n{done.stderr[-3000:]}")
        totals = dump_totals(directory)
        if not totals:
            raise RuntimeError(f"callgrind dumped no window: this Python's ctypes has no {MARK} symbol "
                               f"(a stripped build)")
        with open(os.path.join(directory, "order.json")) as f:
            order = json.load(f)
        return per_call(order, totals, per_window)


def summarize(counts: dict[str, list[float]], J: int, k: int) -> dict:
    """Medians over windows, and PETRA's ratios to the others."""
    medians = {name: statistics.median(values) for name, values in counts.items()}
    return {"J": J, "k": k, "instructions_per_call": counts, "median_per_call": medians, **ratios(medians),
            "spread": {name: (max(v) - min(v)) / statistics.median(v) for name, v in counts.items()}}


def ratios(medians: dict[str, float]) -> dict[str, float]:
    """PETRA's ratios to the other variants, and those of its two floors and of PETRA without ``check_finite`` to
    DeepSpeed's engine, as the ``time`` and ``instructions`` parts of the host-overhead benchmark both report them."""
    deepspeed = medians["deepspeed_1f1b_one_stage"]
    return {"petra/deepspeed": medians["petra"] / deepspeed,
            "petra/torch": medians["petra"] / medians["torch_1f1b_one_stage"],
            "petra/plain": medians["petra"] / medians["plain"],
            "arithmetic_floor/deepspeed": medians["plain_and_petra_forwards"] / deepspeed,
            "structure/deepspeed": medians["petra_structure"] / deepspeed,
            "unchecked/deepspeed": medians["petra_unchecked"] / deepspeed}

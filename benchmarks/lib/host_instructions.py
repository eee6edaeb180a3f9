"""Host instructions per ``train_batch`` on layers of negligible cost, counted by valgrind's callgrind: the
``time`` part's comparison without the machine's noise. A CPU's speed moves with its neighbours, caches and
clock; the instructions a call executes do not, so one run on a busy 2-core VM gives the ratio a quiet machine
would (an instruction is not a fixed time: memory stalls differ, so the count is a proxy, measured beside time).

The benchmark runs itself again under ``valgrind --tool=callgrind`` with collection off except inside
:data:`MARK`, the C function through which ctypes enters a Python callback: each window (``calls``
``train_batch`` calls of one variant) runs as such a callback, handed to libc's ``lfind``. Callgrind dumps the
window's count when the callback returns, so the n-th dump is the n-th window. Everything before (imports,
engine construction, warm-up) and every other thread's idle spinning stays out of the counts.

Callgrind also simulates the caches (``--cache-sim=yes``), with a last level of :data:`LAST_LEVEL` bytes, about what
one core of a shared server keeps near it (its L2 and a share of the L3; the VM reports a 256 MB L3, which would hold
everything): a miss is where an instruction waits for memory. Time is then fitted as a price per instruction plus a
price per last-level miss (:func:`cost_fit`): what the instructions alone leave unexplained.
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

import torch

from petra_ds.runtime.distributed import free_port

from .example_runs import ROOT

#: CPython's ctypes trampoline into a Python callback (libc's own symbols are not named in its debug info)
MARK = "closure_fcn"
_COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_EVENTS = re.compile(rb"^events:((?: \w+)+)", re.MULTILINE)
_TOTALS = re.compile(rb"^totals:((?: \d+)+)", re.MULTILINE)
_SUMMARY = re.compile(rb"^summary:((?: \d+)+)", re.MULTILINE)
#: the simulated last-level cache: bytes, ways, line bytes (valgrind's ``--LL``)
LAST_LEVEL = (1 << 20, 16, 64)
#: the last-level misses: instruction fetches, data reads, data writes
MISSES = ("ILmr", "DLmr", "DLmw")


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


def dump_totals(directory: str) -> list[dict[str, int]]:
    """The counts of each callgrind dump in ``directory`` by event (``Ir``: instructions; with the cache simulation
    its misses too), in dump order (``cg.<pid>.<n>``)."""
    numbered = []
    for path in glob.glob(os.path.join(directory, "cg.*.*")):
        suffix = path.rsplit(".", 1)[1]
        if suffix.isdigit():
            with open(path, "rb") as f:
                text = f.read()
            events, found = _EVENTS.search(text), _TOTALS.search(text) or _SUMMARY.search(text)
            if events is None or found is None:
                raise RuntimeError(f"{path} has no events or totals line: not a callgrind dump")
            counts = dict(zip(events.group(1).decode().split(), map(int, found.group(1).split())))
            numbered.append((int(suffix), counts))  # a total line leaves out the events it counts none of
    return [counts for _, counts in sorted(numbered)]


def misses(counts: dict[str, int]) -> int:
    """The last-level misses of one dump's ``counts``."""
    return sum(counts.get(event, 0) for event in MISSES)


def per_call(order: list[str], totals: list[int], per_window: int) -> dict[str, list[float]]:
    """Instructions per call of each window, by variant."""
    if len(order) != len(totals):
        raise RuntimeError(f"{len(order)} windows ran but callgrind dumped {len(totals)}: something else in the "
                           f"process entered {MARK} (another ctypes callback)")
    out: dict[str, list[float]] = {}
    for name, total in zip(order, totals):
        out.setdefault(name, []).append(total / per_window)
    return out


def count(argv: list[str], rounds: int, per_window: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run ``python -m benchmarks.host_overhead <argv> --windows-to DIR`` under callgrind; instructions and
    last-level misses per call of each window, by variant."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--parts instructions counts with valgrind's callgrind, which is not on PATH: install "
                         "valgrind (apt install valgrind) or leave the part out")
    with tempfile.TemporaryDirectory(prefix="callgrind-") as directory:
        cmd = [valgrind, "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={MARK}",
               f"--dump-after={MARK}", f"--callgrind-out-file={os.path.join(directory, 'cg.%p')}",
               "--cache-sim=yes", "--LL=" + ",".join(map(str, LAST_LEVEL)),
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
        return (per_call(order, [t["Ir"] for t in totals], per_window),
                per_call(order, list(map(misses, totals)), per_window))


def summarize(counts: dict[str, list[float]], J: int, k: int, missed: dict[str, list[float]] | None = None) -> dict:
    """Medians over windows, and PETRA's ratios to the others; ``missed``: last-level misses per call, the same."""
    medians = {name: statistics.median(values) for name, values in counts.items()}
    summary = {"J": J, "k": k, "instructions_per_call": counts, "median_per_call": medians, **ratios(medians),
               "spread": {name: (max(v) - min(v)) / statistics.median(v) for name, v in counts.items()}}
    if missed is not None:
        miss_medians = {name: statistics.median(values) for name, values in missed.items()}
        summary["last_level"] = {"cache": dict(zip(("bytes", "ways", "line_bytes"), LAST_LEVEL)),
                                 "misses_per_call": missed, "median_misses_per_call": miss_medians,
                                 **ratios(miss_medians)}
    return summary


def cost_fit(seconds: dict[str, float], instructions: dict[str, float], missed: dict[str, float]) -> dict:
    """Least squares of each variant's host seconds per call as ``a`` seconds per instruction plus ``b`` per
    last-level miss, over the variants both measured; the fitted seconds, and PETRA's excess over DeepSpeed's
    engine and over ``petra_structure`` in the two parts. A fit that misses the measured times says that the two
    counts do not explain them."""
    names = [name for name in seconds if name in instructions and name in missed]
    counts = torch.tensor([[instructions[n], missed[n]] for n in names], dtype=torch.float64)
    times = torch.tensor([[seconds[n]] for n in names], dtype=torch.float64)
    a, b = torch.linalg.lstsq(counts, times).solution.flatten().tolist()
    fitted = {n: a * instructions[n] + b * missed[n] for n in names}

    def excess(over: str) -> dict[str, float]:
        return {"seconds": seconds["petra"] - seconds[over],
                "instructions_seconds": a * (instructions["petra"] - instructions[over]),
                "misses_seconds": b * (missed["petra"] - missed[over])}

    return {"seconds_per_instruction": a, "seconds_per_miss": b, "fitted_seconds_per_call": fitted,
            "largest_misfit": max(abs(fitted[n] / seconds[n] - 1) for n in names),
            "petra_over_deepspeed": excess("deepspeed_1f1b_one_stage"),
            "petra_over_structure": excess("petra_structure")}


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

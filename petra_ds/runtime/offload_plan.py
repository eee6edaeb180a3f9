"""``"petra": {"fifo_offload": "auto"}``: which stages keep their input FIFO in host memory, decided from what the
first ``train_batch`` measured.

In a steady clock an offloading stage copies one entry out to host memory and one back (``runtime/fifo.py``: a
side stream each), overlapping the stage's compute. The offload is free where those copies take no longer than
that compute, counted one after the other (a margin where the link carries both directions at once)::

    2 * entry_bytes / link_bytes_per_s <= COMPUTE_PER_FORWARD * forward_seconds

A steady clock runs one forward and one backward, the backward about two forwards (a FIFO stage's backward also
evaluates its forward again, which only adds slack), hence 3 forwards. The host link's bandwidth is measured once
at start-up, a pinned round trip; a stage's forward time (CUDA events) and its entry's bytes in the first
``train_batch`` whose clocks ran a forward of the stage, read at that window's end, after the loss. Until then the
entries stay on the device; a stage that decides to offload moves every entry but the head out at once. On a
CPU the device is host memory: nothing leaves, and no planner runs.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..schedule import ForwardPass
from .observe import Observer

if TYPE_CHECKING:
    from ..schedule import Window
    from .engine import PetraEngine

#: a steady clock's compute in forwards: one forward and one backward of about two
COMPUTE_PER_FORWARD = 3.0


def copies_hide(entry_bytes: int, link_bytes_per_s: float, forward_seconds: float) -> bool:
    """Whether one entry out and one back fit under a steady clock's compute (the rule above)."""
    return 2 * entry_bytes / link_bytes_per_s <= COMPUTE_PER_FORWARD * forward_seconds


def link_bytes_per_s(device: torch.device, nbytes: int = 64 << 20) -> float | None:
    """Bytes per second between pinned host memory and ``device``, a round trip timed once (None on a CPU)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    on_device.copy_(host, non_blocking=True)  # the first copy pays for setting the path up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host.copy_(on_device, non_blocking=True)
    on_device.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    return 2 * nbytes / (start.elapsed_time(end) / 1e3)


def describe(stage: int, decision: dict[str, Any]) -> str:
    """The line a rank prints for one of its stages' decisions."""
    where = "offloads its inputs to host memory" if decision["offload"] else "keeps its inputs on the device"
    return (f"fifo_offload auto: stage {stage} {where} (an entry of {decision['entry_bytes'] / 2**20:.2f} MiB out "
            f"and back: {decision['copies_s'] * 1e3:.3f} ms; {COMPUTE_PER_FORWARD:g} forwards: "
            f"{COMPUTE_PER_FORWARD * decision['forward_s'] * 1e3:.3f} ms)")


class Timer(Protocol):
    """Marks on the compute stream and the seconds between two of them (read after the window's end)."""

    def mark(self) -> Any:
        """A mark at this point of the compute stream."""

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``; the host waits for ``end``."""


class CudaTimer:
    """CUDA events on the current stream."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class OffloadPlanner(Observer):
    """Times the forwards of this rank's stages that keep inputs, and at the end of the first window that ran
    one of a stage's forwards decides that stage's offload by :func:`copies_hide`. Moves where entries wait,
    never what is computed (offloaded training equals training without, bit for bit). Stops watching once every
    stage has decided; ``decisions`` holds each decision with its numbers."""

    def __init__(self, engine: PetraEngine, link: float, timer: Timer | None = None) -> None:
        self.link = link
        self.timer: Timer = CudaTimer() if timer is None else timer
        self.pending = {j for j, st in engine.stages.items() if st.has_input_fifo}
        self._open: dict[int, Any] = {}
        self._marks: dict[int, list[tuple[Any, Any]]] = {}
        #: per stage: whether it offloads, its entry's bytes, its forward's seconds, the copies' seconds
        self.decisions: dict[int, dict[str, Any]] = {}

    def before_instruction(self, engine: PetraEngine, instruction: Any) -> None:
        if isinstance(instruction, ForwardPass) and instruction.stage in self.pending:
            self._open[instruction.stage] = self.timer.mark()

    def after_instruction(self, engine: PetraEngine, instruction: Any) -> None:
        if isinstance(instruction, ForwardPass) and instruction.stage in self._open:
            start = self._open.pop(instruction.stage)
            self._marks.setdefault(instruction.stage, []).append((start, self.timer.mark()))

    def window_end(self, engine: PetraEngine, window: Window) -> None:
        for j in sorted(self._marks):
            stage = engine.stages[j]
            entry = stage.kept_entry_bytes()
            if entry is None:
                continue
            forward = statistics.median(self.timer.seconds(a, b) for a, b in self._marks.pop(j))
            offload = copies_hide(entry, self.link, forward)
            if offload:
                stage.offload_inputs()
            self.decisions[j] = {"offload": offload, "entry_bytes": entry, "forward_s": forward,
                                 "copies_s": 2 * entry / self.link}
            self.pending.discard(j)
            print(describe(j, self.decisions[j]), flush=True)
        if not self.pending:
            engine.unobserve(self)

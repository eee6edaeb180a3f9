"""A stage's input FIFO: the exact inputs a non-reversible stage keeps from its forward to its delayed backward,
and, with ``"petra": {"fifo_offload": "cpu"}``, where each one waits in between.

The schedule says when an entry is read: the one stored at clock t is read by the stage's ``DelayedBackward`` at
clock t + 2(J-1-j), and entries leave in the order they came. So an entry need not wait on the device. With an
offload, it is copied to host memory as it is stored and its device copy is dropped; after each read, the new
head starts back to the device, one clock before its own read in steady state. An entry stored into an empty FIFO
is the next one read and keeps its device copy, so the head is always on the device or on its way there: a read
waits on that copy's event on the compute stream, never on the host.

How bytes move is a :class:`Copies`, injectable so that a test can hold copies back and check the order.
:class:`StreamCopies` copies on side CUDA streams, one per direction, through pinned host memory, ordered by events;
on CPU its copy is a plain copy. An entry moves storage by storage: each distinct storage behind its tensors is
copied once, whole, and the tensors are rebuilt as the same views of the copy (sizes, strides, offsets), so the
backward reads the layout the forward stored and computes the same bits; a tensor that is its storage, whole and
contiguous, is that copy itself.
"""

from __future__ import annotations

import operator
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import Tensor

from ..nn.accumulate import REQUIRES_GRAD
from ..util.nested import map_tensors, tensors_in
from .ledger import tensor_bytes

#: the values ``"petra.fifo_offload"`` takes: "none" keeps every entry on the device, "cpu" offloads to host memory,
#: "auto" offloads where the copies hide under the stage's compute (``runtime/offload_plan.py``)
FIFO_OFFLOADS = ("none", "cpu", "auto")


class Copies(Protocol):
    """How an entry's bytes move between the device and the host. Each copy takes flat byte buffers (one per
    storage) and returns their copies, maybe still being written, with an event that marks them written (None:
    written already)."""

    def to_host(self, buffers: list[Tensor]) -> tuple[list[Tensor], Any]:
        """Host copies of ``buffers``, started."""

    def to_device(self, buffers: list[Tensor], device: torch.device, after: Any = None) -> tuple[list[Tensor], Any]:
        """Copies of the host ``buffers`` on ``device``, started once ``after`` (the event of the copy that wrote
        them; None: written already) has passed."""

    def wait(self, event: Any) -> None:
        """What the compute stream runs next runs after ``event``; the host goes on."""

    def finish(self, event: Any) -> None:
        """The host waits for ``event`` (a checkpoint reads host copies; never inside a window)."""


class _HostCopies(threading.local):
    active: bool = False


#: true while :class:`StreamCopies` allocates the host copies of tensors that are on the CPU already, where host and
#: device memory are one: ``petra_ds.diagnostics.allocated`` counts what is allocated then as host memory, as a GPU
#: run's pinned copies are
HOST_COPIES = _HostCopies()


class StreamCopies:
    """Copies on side CUDA streams, through pinned host memory, ordered by events; tensors on the CPU are copied
    plainly (the same bits, nothing to wait for). Each direction has its own stream per device, so that the copies
    out and the copies back run at once on the link's two directions instead of queueing behind each other (one
    process hosting RevNet18's ten stages moves about 830 MB of messages each way per clock)."""

    def __init__(self) -> None:
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}

    def _side(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        stream = self._streams.get((device, direction))
        if stream is None:
            stream = self._streams[device, direction] = torch.cuda.Stream(device=device)
        return stream

    def to_host(self, buffers: list[Tensor]) -> tuple[list[Tensor], Any]:
        """Device to pinned host memory on the stream of copies out, after what the compute stream queued (which
        made them); each device buffer is marked used by that stream, so that dropping it cannot hand its memory to
        new work before the copy has read it."""
        if not buffers or not buffers[0].is_cuda:
            HOST_COPIES.active = True
            try:
                return _copied(buffers, "cpu"), None
            finally:
                HOST_COPIES.active = False
        device = buffers[0].device
        side = self._side(device, "out")
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            host = [torch.empty(b.shape, dtype=b.dtype, pin_memory=True) for b in buffers]
            torch._foreach_copy_(host, buffers, non_blocking=True)
            for b in buffers:
                b.record_stream(side)
            return host, side.record_event()

    def to_device(self, buffers: list[Tensor], device: torch.device, after: Any = None) -> tuple[list[Tensor], Any]:
        """Host to device on the stream of copies back, once the copy out that wrote ``buffers`` (``after``, on
        the other stream) has. The device memory is taken on the compute stream, which reads it; the side stream
        first waits for what the compute stream queued, which may still use that memory."""
        if device.type != "cuda":
            return _copied(buffers, device), None
        current = torch.cuda.current_stream(device)
        out = [torch.empty(b.shape, dtype=b.dtype, device=device) for b in buffers]
        side = self._side(device, "back")
        side.wait_stream(current)
        if after is not None:
            side.wait_event(after)
        with torch.cuda.stream(side):
            torch._foreach_copy_(out, buffers, non_blocking=True)
            return out, side.record_event()

    def wait(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def finish(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


def _copied(buffers: list[Tensor], device: torch.device | str) -> list[Tensor]:
    """Plain copies of ``buffers`` on ``device``, in one multi-tensor op."""
    out = [torch.empty(b.shape, dtype=b.dtype, device=device) for b in buffers]
    if out:
        torch._foreach_copy_(out, buffers)
    return out


def moved(value: Any, copy: Callable[[list[Tensor]], tuple[list[Tensor], Any]],
          flat: list[Tensor] | None = None) -> tuple[Any, Any]:
    """``value`` with each distinct storage behind its tensors copied once, whole, by ``copy``, and each tensor
    rebuilt as the same view of its storage's copy; and the copy's event. A tensor alone in its storage, whole and
    contiguous (most of what a stage sends or keeps) is copied as itself: the same bytes and layout, without a byte
    view of its storage and a view rebuilt on the copy (five ops a tensor on the host, for each of the hundreds of
    moves a call makes with ``message_offload``). The copies belong to no autograd graph. ``flat``:
    ``tensors_in(value)``, when the caller has it."""
    flat = tensors_in(value) if flat is None else flat
    storages = list(map(Tensor.untyped_storage, flat))
    keys = list(zip(map(_DEVICE, flat), map(_STORAGE_ADDRESS, storages)))
    alone = list(map(operator.and_, map(Tensor.is_contiguous, flat),
                     map(operator.eq, map(_STORAGE_BYTES, storages), map(_BYTES, flat))))
    if len(set(keys)) < len(keys):
        shared = {key for key, n in Counter(keys).items() if n > 1}
        alone = [whole and key not in shared for whole, key in zip(alone, keys)]
    if any(map(REQUIRES_GRAD, flat)):
        flat = list(map(Tensor.detach, flat))
    if all(alone):
        copies, event = copy(flat)
    else:
        copies, event = _by_storage(flat, storages, keys, alone, copy)
    rest = iter(copies)
    return map_tensors(lambda _: next(rest), value), event


def _by_storage(flat: list[Tensor], storages: list[torch.UntypedStorage], keys: list[tuple[torch.device, int]],
                alone: list[bool], copy: Callable[[list[Tensor]], tuple[list[Tensor], Any]]) -> tuple[list[Tensor], Any]:
    """:func:`moved`'s copies of ``flat`` where some tensors share a storage or are a part of theirs: each such
    storage copied whole as bytes and its tensors rebuilt as the same views of the copy; the others (``alone``)
    copied as themselves."""
    index: dict[tuple[torch.device, int], int] = {}
    buffers: list[Tensor] = []
    for t, storage, key, itself in zip(flat, storages, keys, alone):
        if key not in index:
            index[key] = len(buffers)
            buffers.append(t if itself else torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
    copies, event = copy(buffers)
    out = []
    for t, key, itself in zip(flat, keys, alone):
        target = copies[index[key]]
        out.append(target if itself else torch.empty(0, dtype=t.dtype, device=target.device).set_(
            target.untyped_storage(), t.storage_offset(), t.size(), t.stride()))
    return out, event


_DEVICE = operator.attrgetter("device")
_STORAGE_ADDRESS = torch.UntypedStorage.data_ptr
_STORAGE_BYTES = torch.UntypedStorage.nbytes
_BYTES = operator.attrgetter("nbytes")


@dataclass
class Entry:
    """One micro-batch's input: on the device (``value``, readable once ``ready`` has passed) or in host memory
    only (``host``, written once ``stored`` has passed); ``device`` is where it is read."""

    micro_batch: int
    value: Any
    device: torch.device | None = None
    host: Any = None
    stored: Any = None
    ready: Any = None
    #: the bytes of its tensors, the same on the device and in host memory (set by the FIFO that holds it)
    nbytes: int = 0

    @classmethod
    def offloaded(cls, m: int, x: Any, copies: Copies, flat: list[Tensor] | None = None) -> Entry:
        """Micro-batch ``m``'s ``x``, its copy to host memory started; the caller drops the device copy, whose
        memory is free once the copy has read it. ``flat``: ``tensors_in(x)``, when the caller has it."""
        flat = tensors_in(x) if flat is None else flat
        host, stored = moved(x, copies.to_host, flat)
        return cls(m, None, flat[0].device, host, stored)

    def fetch(self, copies: Copies) -> None:
        """Start the entry back to its device (a no-op when it is there or on its way); its host copy is dropped,
        its memory free once the copy has read it."""
        if self.value is None:
            self.value, self.ready = moved(self.host,
                                           lambda buffers: copies.to_device(buffers, self.device, self.stored))
            self.host = self.stored = None

    def settled(self, copies: Copies | None) -> Any:
        """The entry where it is, its copy written (the host waits for a host copy: only between windows)."""
        if self.value is None:
            copies.finish(self.stored)
            return self.host
        if self.ready is not None:
            copies.wait(self.ready)
        return self.value


def saved_entries(state: Any) -> list[tuple[int, Any]]:
    """A saved FIFO's (micro-batch, input) pairs (:meth:`InputFifo.state`); stage 0's micro-batches were a
    dictionary by micro-batch in checkpoints written before they could be offloaded."""
    return list(state.items() if isinstance(state, dict) else state)


class InputFifo:
    """The inputs a stage keeps for its delayed backwards, read in the order they were stored; with ``copies``,
    every entry but the head waits in host memory. The bytes on the device are counted as entries come, go and
    move (:attr:`device_bytes`), so that a stage's ledger reads them after every instruction without a walk."""

    def __init__(self, copies: Copies | None = None) -> None:
        """``copies``: how entries move to host memory and back (None: they stay on the device)."""
        self.copies = copies
        self._entries: deque[Entry] = deque()
        #: the bytes of the entries held on the device (``tensor_bytes(self.on_device())``)
        self.device_bytes = 0

    @property
    def offloads(self) -> bool:
        """Whether entries wait in host memory."""
        return self.copies is not None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def head(self) -> int | None:
        """The micro-batch read next (None when empty)."""
        return self._entries[0].micro_batch if self._entries else None

    def micro_batches(self) -> list[int]:
        return [e.micro_batch for e in self._entries]

    def append(self, m: int, x: Any) -> None:
        """Keep ``x``, micro-batch ``m``'s input. Offloaded unless it is the next one read: the device copy is
        dropped here, its memory free once the copy has read it."""
        offload = self.copies is not None and len(self._entries) > 0
        entry = Entry.offloaded(m, x, self.copies) if offload else Entry(m, x)
        entry.nbytes = tensor_bytes(x)
        if not offload:
            self.device_bytes += entry.nbytes
        self._entries.append(entry)

    def start_offloading(self, copies: Copies) -> None:
        """Offload from now on: every entry but the head leaves for host memory now, later ones as they are
        stored."""
        if self.copies is not None:
            return
        self.copies = copies
        kept = list(self._entries)
        self._entries.clear()
        self.device_bytes = 0
        for e in kept:
            self.append(e.micro_batch, e.value)

    def pop(self, m: int) -> Any:
        """The head, micro-batch ``m``'s input, on the device with the compute stream ordered after its copy;
        then the new head starts back to the device."""
        if self.head != m:
            raise RuntimeError(f"the FIFO's head is micro-batch {self.head}, not {m}")
        entry = self._entries.popleft()
        if entry.value is None:
            raise RuntimeError(f"micro-batch {m}'s input is read while it is in host memory only: its prefetch "
                               "was never started")
        if entry.ready is not None:
            self.copies.wait(entry.ready)
        self.device_bytes -= entry.nbytes
        self._prefetch_head()
        return entry.value

    def _prefetch_head(self) -> None:
        """Start the head back to the device (a no-op when it is there)."""
        if self._entries and self._entries[0].value is None:
            head = self._entries[0]
            head.fetch(self.copies)
            self.device_bytes += head.nbytes

    def on_device(self) -> tuple:
        """The entries held on the device (the head, and every entry without an offload)."""
        return tuple(e.value for e in self._entries if e.value is not None)

    def on_host(self) -> tuple:
        """The host copies of the offloaded entries."""
        return tuple(e.host for e in self._entries if e.host is not None)

    def state(self) -> list[tuple[int, Any]]:
        """Every entry as (micro-batch, input) for a checkpoint, an offloaded one as its host copy. Waits for
        the copies (the host, for a host copy): only between windows."""
        return [(e.micro_batch, e.settled(self.copies)) for e in self._entries]

    def load(self, entries: Iterable[tuple[int, Any]]) -> None:
        """Replace the entries by ``entries`` (a checkpoint's, on the device), kept as if stored in this order."""
        for e in self._entries:
            if e.ready is not None:  # the memory a prefetch writes goes back only after the write
                self.copies.wait(e.ready)
        self._entries.clear()
        self.device_bytes = 0
        for m, x in entries:
            self.append(m, x)

"""Peak memory as the allocator sees it, on any device: every tensor storage alive in this process.

:class:`AllocatedStorages` counts the storages of every tensor alive when it starts (a scan of the
interpreter's objects: parameters, optimizer state, data, anything a Python object holds) and, while
active, every storage an operator creates (a ``TorchDispatchMode`` sees each result: activations,
gradients, optimizer state made lazily, saved tensors, recompute graphs, communication buffers). A weak
reference to each storage tells when it is freed, so ``live_bytes`` follows the allocator and
``peak_bytes`` is its high-water mark. At each new peak, ``parts()`` (when given) names what the peak is
made of: the bytes of the storages it lists by name (parameters, gradients, optimizer state), the rest
being ``"other"`` (activations, buffers, messages).

It does not see memory that never becomes a tensor (a communication library's own buffers, the
allocator's caching slack) nor tensors created before it started that no Python object reaches. On CUDA
``torch.cuda.max_memory_allocated`` is the number to report; this counter is for the CPU, where torch has
no such statistic. There it stands for a device's memory: the host copies that ``fifo_offload`` and
``message_offload`` make (``runtime.fifo.HOST_COPIES``), pinned host memory on a GPU, count apart
(``host_bytes``), in neither ``live_bytes`` nor the peak.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.fifo import HOST_COPIES
from ..runtime.ledger import StorageKey, storage, storage_bytes
from ..util.nested import tensors_in


class AllocatedStorages(TorchDispatchMode):
    """Live and peak bytes of every tensor storage of this process while the ``with`` block runs."""

    def __init__(self, parts: Callable[[], dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.parts = parts
        self.live_bytes = 0
        self.peak_bytes = 0
        #: the bytes of the host copies alive (``runtime.fifo.HOST_COPIES``), and their high-water mark
        self.host_bytes = 0
        self.peak_host_bytes = 0
        #: what the peak was made of, by the names of ``parts()`` plus "other"
        self.peak_parts: dict[str, int] = {}
        self._live: dict[StorageKey, int] = {}
        self._host: dict[StorageKey, int] = {}
        self._lock = threading.Lock()  # storages may be freed on autograd's threads (CUDA)

    def __enter__(self) -> "AllocatedStorages":
        # the scan sees unreachable cycles too: counted, then freed by a collection inside the block, they would take
        # the count below where it started and hide the block's own peak
        gc.collect()
        for obj in gc.get_objects():
            if issubclass(type(obj), Tensor):  # type(), not isinstance: some modules' objects warn on __class__
                self._add(obj)
        self._note_peak()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            self._add(t)
        if self.live_bytes > self.peak_bytes:
            self._note_peak()
        return out

    def _add(self, t: Tensor) -> None:
        if t.is_meta or t.layout != torch.strided:
            return
        try:
            key, nbytes = storage(t)
        except (NotImplementedError, RuntimeError):  # a wrapper subclass without a storage of its own
            return
        host = HOST_COPIES.active
        with self._lock:
            if key in self._live or key in self._host or nbytes == 0:
                return
            if host:
                self._host[key] = nbytes
                self.host_bytes += nbytes
                self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
            else:
                self._live[key] = nbytes
                self.live_bytes += nbytes
        weakref.finalize(t.untyped_storage(), self._free, key)

    def _free(self, key: StorageKey) -> None:
        with self._lock:
            self.live_bytes -= self._live.pop(key, 0)
            self.host_bytes -= self._host.pop(key, 0)

    def _note_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        if self.parts is None:
            return
        seen: set[StorageKey] = set()
        named = {name: storage_bytes(obj, seen) for name, obj in self.parts().items()}
        self.peak_parts = {**named, "other": self.live_bytes - sum(named.values())}

    @staticmethod
    def training_parts(params: list[Tensor], optimizer: Any) -> Callable[[], dict[str, Any]]:
        """``parts`` for a model being trained: its parameters, their gradients and the optimizer's state."""
        return lambda: {"parameters": params, "gradients": [p.grad for p in params],
                        "optimizer_state": list(getattr(optimizer, "state", {}).values())}

    def reset_peak(self) -> int:
        """The peak so far; the next one starts from what is live now."""
        peak = self.peak_bytes
        self._note_peak()
        return peak

"""What reads a device value on the host, and a counter of such reads that runs on any device.

On a GPU a read of a device value on the host (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, an op whose
output shape depends on values) makes the host wait for the device, and a CUDA graph cannot hold one. These are
properties of the program, so a CPU run finds them as a GPU run would meet them: ``diagnostics.host_cost`` counts
them per ``train_batch``, and ``runtime.graphed`` looks for them in what it is about to capture.
"""

from __future__ import annotations

import collections
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: ops that read a tensor's values on the host, or whose output shape depends on them (a sync on a GPU)
SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                         "unique_consecutive", "unique_dim", "equal", "is_nonzero", "repeat_interleave"})
#: tensor methods that copy a tensor's values to host memory
SYNCING_METHODS = ("tolist", "cpu", "numpy", "__array__")


class _SyncingOps(TorchDispatchMode):
    def __init__(self, owner: "HostSyncs") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            self.owner.note(f"aten.{name}")
        return func(*args, **(kwargs or {}))


class HostSyncs(TorchFunctionMode):
    """Counts the host reads of tensor values while active (``count``), each with the first line of code
    outside torch that made it (``where``): the aten ops of :data:`SYNCING_OPS` and the methods of
    :data:`SYNCING_METHODS`. A ``.tolist()`` is one read, however many ops it runs inside."""

    def __init__(self) -> None:
        super().__init__()
        self.where: collections.Counter[str] = collections.Counter()
        self._ops = _SyncingOps(self)
        self._inside = 0

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def note(self, what: str) -> None:
        if self._inside:
            return
        self.where[f"{what} at {_caller()}"] += 1

    def __enter__(self):
        self._ops.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._ops.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING_METHODS and args and isinstance(args[0], torch.Tensor):
            self.note(f"Tensor.{name}")
            self._inside += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self._inside -= 1
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path != here and not path.startswith(torch_dir):
            return f"{os.path.relpath(path)}:{frame.lineno}"
    return "?"

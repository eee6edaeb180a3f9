"""What a clock costs the host, counted without a GPU: the aten ops it dispatches and the host syncs it makes.

On a GPU every aten op is at least one kernel launch the host pays for, and every read of a device value on
the host (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, an op whose output shape depends on values)
makes the host wait for the device to catch up. Both are properties of the program, not of the machine, so a
CPU run counts them as a GPU run would meet them:

- :class:`OpCounter` counts the ops dispatched (a ``TorchDispatchMode``: each op once, as the dispatcher sees
  it from Python, whatever its kernel does inside), by name and by the scope it ran in, and the tensors a
  multi-tensor (``_foreach_*``) op would take one by one on CUDA though its fused kernel could take them;
- :class:`HostSyncs` counts the reads of tensor values on the host, with the line of code that made each;
- :class:`Bytecodes` counts the Python bytecodes interpreted, by package: the host work around the ops, which on a
  GPU decides the pace of a call as much as the ops do where the device waits for the host;
- :class:`InstructionScopes` is the observer that tells the counters which instruction of which stage
  runs (``engine.observe``), so that counts come per stage and per instruction.

On a CPU run every tensor lives on the host, so ``HostSyncs`` counts every value read whatever its device:
on a GPU the optimizer's host-side step counters (torch's non-fused optimizers keep ``step`` on the CPU)
would not sync; the engine's own reads would.
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
from types import FrameType
from typing import Any, Callable, Hashable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.finite import fusable
from ..runtime.observe import Observer

#: ops that read a tensor's values on the host, or whose output shape depends on them (a sync on a GPU)
SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                         "unique_consecutive", "unique_dim", "equal", "is_nonzero", "repeat_interleave"})
#: tensor methods that copy a tensor's values to host memory
SYNCING_METHODS = ("tolist", "cpu", "numpy", "__array__")


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active: ``by_name[op]`` and ``by_scope[scope][op]``, where
    ``scope`` is whatever was last set (``None`` outside any)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: collections.Counter[str] = collections.Counter()
        self.by_scope: dict[Hashable, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.scope: Hashable = None
        #: per multi-tensor op, the tensors CUDA would reduce or update one by one only because another tensor of
        #: their list is unlike them: its fused kernels take a list of dense tensors of one dtype, and any other
        #: list goes tensor by tensor, a kernel or two each (the count a CPU run can make of that GPU cost)
        self.dragged: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.by_name[name] += 1
        self.by_scope[self.scope][name] += 1
        if name.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
            self.dragged[name] += _dragged(args[0])
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def scope_totals(self) -> dict[Hashable, int]:
        return {scope: sum(counts.values()) for scope, counts in self.by_scope.items()}


def _dragged(tensors: list) -> int:
    """The fusable tensors of a multi-tensor op's list that go one by one with it: all of them when the list
    mixes dtypes or holds a tensor that is not dense, else none."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    fused = [fusable(t) for t in tensors]
    if all(fused) and len({t.dtype for t in tensors}) <= 1:
        return 0
    return sum(fused)


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


class Bytecodes:
    """Counts the bytecodes the Python interpreter runs on this thread while active (``total``), by the package
    of their code (``by_area``: ``petra_ds.<subpackage>``, ``torch``, ``deepspeed``, or ``other``). Machine-
    independent, as op counts are: a C call (an op, a ``dict`` copy) is one bytecode whatever it costs, so the
    count measures the interpreted glue around the ops, not the ops. Tracing slows Python tenfold or more: count
    one call, not a timed one."""

    def __init__(self) -> None:
        self.by_area: collections.Counter[str] = collections.Counter()
        self._areas: dict[str, str] = {}
        self._previous: Callable | None = None

    @property
    def total(self) -> int:
        return sum(self.by_area.values())

    def __enter__(self) -> "Bytecodes":
        self._previous = sys.gettrace()
        sys.settrace(self._frame)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self._previous)

    def _frame(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        if frame.f_code is _EXIT:  # the counter's own way out
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        area = self._areas.get(frame.f_code.co_filename)
        if area is None:
            area = self._areas[frame.f_code.co_filename] = _area(frame.f_code.co_filename)
        counts = self.by_area

        def opcode(frame: FrameType, event: str, arg: Any) -> Callable:
            if event == "opcode":
                counts[area] += 1
            return opcode

        return opcode


_EXIT = Bytecodes.__exit__.__code__


def _area(path: str) -> str:
    """``petra_ds.<subpackage>``, ``torch``, ``deepspeed`` or ``other`` for a code object's file."""
    parts = os.path.abspath(path).split(os.sep)
    for name in ("petra_ds", "torch", "deepspeed"):
        if name in parts:
            below = parts[parts.index(name) + 1:]
            if name == "petra_ds" and len(below) > 1:
                return f"petra_ds.{below[0]}"
            return name
    return "other"


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path != here and not path.startswith(torch_dir):
            return f"{os.path.relpath(path)}:{frame.lineno}"
    return "?"


class InstructionScopes(Observer):
    """Sets ``counter.scope`` to ``(stage, instruction name)`` around every instruction the engine runs, and
    back to ``None`` after: what the engine does between instructions (the window's end, its read) stays
    unscoped."""

    def __init__(self, counter: OpCounter) -> None:
        self.counter = counter

    def before_instruction(self, engine: Any, instruction: Any) -> None:
        self.counter.scope = (instruction.kwargs.get("stage"), type(instruction).__name__)

    def after_instruction(self, engine: Any, instruction: Any) -> None:
        self.counter.scope = None

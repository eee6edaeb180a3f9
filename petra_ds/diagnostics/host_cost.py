"""What a clock costs the host, counted without a GPU: the aten ops it dispatches and the host syncs it makes.

On a GPU every aten op is at least one kernel launch the host pays for, and every read of a device value on
the host (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, an op whose output shape depends on values)
makes the host wait for the device to catch up. Both are properties of the program, not of the machine, so a
CPU run counts them as a GPU run would meet them:

- :class:`OpCounter` counts the ops dispatched (a ``TorchDispatchMode``: each op once, as the dispatcher sees
  it from Python, whatever its kernel does inside), by name and by the scope it ran in, and the tensors a
  multi-tensor (``_foreach_*``) op would take one by one on CUDA though its fused kernel could take them;
- ``util.host_reads.HostSyncs`` counts the reads of tensor values on the host, with the line of code that made
  each (in ``util``: ``runtime.graphed`` uses it too);
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
import gc
import os
import sys
import threading
from types import CodeType, FrameType
from typing import Any, Callable, Hashable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.finite import fusable
from ..runtime.graphed import REPLAY_LABEL
from ..runtime.observe import Observer

class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active: ``by_name[op]`` and ``by_scope[scope][op]``, where
    ``scope`` is whatever was last set (``None`` outside any). A replay of ``"cuda_graphs": "emulate"``'s eager
    stand-ins counts as the one launch a CUDA graph's replay is (``graph_replay``); the ops it runs go to
    ``in_graphs``."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: collections.Counter[str] = collections.Counter()
        self.by_scope: dict[Hashable, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.scope: Hashable = None
        #: per multi-tensor op, the tensors CUDA would reduce or update one by one only because another tensor of
        #: their list is unlike them: its fused kernels take a list of dense tensors of one dtype, and any other
        #: list goes tensor by tensor, a kernel or two each (the count a CPU run can make of that GPU cost)
        self.dragged: collections.Counter[str] = collections.Counter()
        self.in_graphs: collections.Counter[str] = collections.Counter()
        self._ranges: list[str] = []  # the profiler ranges open, innermost last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "profiler" and self._replay_range(name, args):
            return func(*args, **(kwargs or {}))
        if REPLAY_LABEL in self._ranges:
            self.in_graphs[name] += 1
            return func(*args, **(kwargs or {}))
        self.by_name[name] += 1
        self.by_scope[self.scope][name] += 1
        if name.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
            self.dragged[name] += _dragged(args[0])
        return func(*args, **(kwargs or {}))

    def _replay_range(self, name: str, args: tuple) -> bool:
        """Follows the profiler ranges opened and closed; whether this op opens or closes a replay's (counted as the
        one ``graph_replay``)."""
        if name == "_record_function_enter_new":
            label = args[0] if args and isinstance(args[0], str) else ""
            self._ranges.append(label)
            if label == REPLAY_LABEL and self._ranges.count(REPLAY_LABEL) == 1:
                self.by_name["graph_replay"] += 1
                self.by_scope[self.scope]["graph_replay"] += 1
            return label == REPLAY_LABEL
        if name == "_record_function_exit" and self._ranges:
            return self._ranges.pop() == REPLAY_LABEL
        return False

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


class Bytecodes:
    """Counts the bytecodes the Python interpreter runs on this thread while active (``total``), by the package
    of their code (``by_area``: ``petra_ds.<subpackage>``, ``torch``, ``deepspeed``, or ``other``). Machine-
    independent, as op counts are: a C call (an op, a ``dict`` copy) is one bytecode whatever it costs, so the
    count measures the interpreted glue around the ops, not the ops. Tracing slows Python tenfold or more: count
    one call, not a timed one. Earlier garbage is collected on entry and the collector waits while counting: the
    finalizers of another run's objects are not this call's bytecodes.

    From Python 3.12 the interpreter's instruction events (``sys.monitoring``) count, every code object from its
    first run on (``sys.settrace``'s opcode events there skip a code object's first traced run: the first call a
    process traces on 3.12.1, every code object's on 3.13.0); before 3.12, ``sys.settrace``'s opcode events, in
    the frames called inside the block."""

    def __init__(self) -> None:
        self.by_area: collections.Counter[str] = collections.Counter()
        self._areas: dict[str, str] = {}
        self._previous: Callable | None = None
        self._tool: int | None = None

    @property
    def total(self) -> int:
        return sum(self.by_area.values())

    def __enter__(self) -> "Bytecodes":
        tool = None if _MONITORING is None else _free_tool()  # before the collector stops: it may raise
        gc.collect()
        self._collecting = gc.isenabled()
        gc.disable()
        if tool is None:
            self._previous = sys.gettrace()
            sys.settrace(self._frame)
            return self
        self._tool = tool
        _MONITORING.use_tool_id(self._tool, "petra_ds bytecodes")
        _MONITORING.register_callback(self._tool, _MONITORING.events.INSTRUCTION, self._instruction_counter())
        _MONITORING.set_events(self._tool, _MONITORING.events.INSTRUCTION)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tool is None:
            sys.settrace(self._previous)
        else:
            _MONITORING.set_events(self._tool, 0)
            _MONITORING.register_callback(self._tool, _MONITORING.events.INSTRUCTION, None)
            _MONITORING.free_tool_id(self._tool)
            self._tool = None
        if self._collecting:
            gc.enable()

    def _area_of(self, path: str) -> str:
        area = self._areas.get(path)
        if area is None:
            area = self._areas[path] = _area(path)
        return area

    def _instruction_counter(self) -> Callable[[CodeType, int], None]:
        """The callback of each instruction event: counts those of this thread, the counter's own way in and out
        aside."""
        thread, counts, area_of, own = threading.get_ident(), self.by_area, self._area_of, _OWN_CODE

        def instruction(code: CodeType, offset: int) -> None:
            if threading.get_ident() == thread and code not in own:
                counts[area_of(code.co_filename)] += 1

        return instruction

    def _frame(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        if frame.f_code in _OWN_CODE:  # the counter's own way out
            return None
        frame.f_trace_lines = False
        frame.f_trace_opcodes = True
        area = self._area_of(frame.f_code.co_filename)
        counts = self.by_area

        def opcode(frame: FrameType, event: str, arg: Any) -> Callable:
            if event == "opcode":
                counts[area] += 1
            return opcode

        return opcode


#: the counter's own way in and out, not counted
_OWN_CODE = frozenset({Bytecodes.__enter__.__code__, Bytecodes.__exit__.__code__})
#: Python 3.12's ``sys.monitoring`` (None before)
_MONITORING = getattr(sys, "monitoring", None)


def _free_tool() -> int:
    """A ``sys.monitoring`` tool id no other tool (a debugger, coverage, a profiler) holds now."""
    for tool in (_MONITORING.PROFILER_ID, 3, 4):
        if _MONITORING.get_tool(tool) is None:
            return tool
    raise RuntimeError("Bytecodes needs a sys.monitoring tool id, and the profiler's and ids 3 and 4 are all taken: "
                       "count without the profiler or tool that holds them")


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

"""How diagnostics, measurement and benchmarks watch the engine without reaching into it.

The engine executes instructions; at fixed points of a clock it calls every registered
:class:`Observer` (``engine.observe(observer)``). An observer reads the engine and its stages through
their public attributes and the read-only :class:`Holdings` view, and talks to other ranks through
``engine.transport``; it never patches the engine or reads its private state. The points, in the order a
clock meets them::

    window_start -> [after_forward ... forwards_done] -> [before_backward, after_backward ...]
                 -> before_step, after_step ... -> clock_end -> ... -> window_end

and around every instruction ``before_instruction`` / ``after_instruction``.

``forwards_done`` comes once per clock after its forwards and the activations' batch, before any
backward or parameter change (what the gradient-quality probe needs). Observers that change what the
engine computes do not exist: every hook runs with the training math already decided. (The engine's own
``fifo_offload: "auto"`` planner, ``runtime/offload_plan.py``, is an observer that moves where FIFO entries wait,
never a bit of what is computed.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from ..schedule import Window
    from .engine import PetraEngine
    from .stage import Stage

#: what starts the ``torch.profiler`` range the engine puts around each instruction while a profiler records
#: ("petra ForwardPass(...)"): how a trace tells the engine's instructions from everything else
INSTRUCTION_LABEL = "petra "


class Observer:
    """No-op hooks; override the ones you need. ``engine`` is the :class:`petra_ds.PetraEngine`."""

    def window_start(self, engine: PetraEngine, window: Window) -> None:
        """A ``train_batch`` or ``drain`` call begins its clocks."""

    def after_forward(self, engine: PetraEngine, stage: int, micro_batch: int, x: Any, labels: Any) -> None:
        """``stage`` ran the forward of ``micro_batch`` on input ``x`` (the last stage: its loss)."""

    def forwards_done(self, engine: PetraEngine, clock: int) -> None:
        """Every forward of ``clock`` ran and its activations were posted; nothing has stepped yet."""

    def before_backward(self, engine: PetraEngine, stage: int, micro_batch: int, delta: Any) -> None:
        """``stage`` is about to run the backward of ``micro_batch`` with incoming gradient ``delta``."""

    def after_backward(self, engine: PetraEngine, stage: int, micro_batch: int, x_tilde: Any) -> None:
        """``stage`` accumulated the gradient of ``micro_batch``; ``x_tilde`` is the input it used."""

    def before_step(self, engine: PetraEngine, stage: int, step: int) -> None:
        """``stage``'s gradients are reduced (data parallel, tied weights, clipped); its optimizer
        steps next."""

    def after_step(self, engine: PetraEngine, stage: int, step: int) -> None:
        """``stage``'s optimizer stepped (or skipped a non-finite step); its gradients are not yet cleared."""

    def clock_end(self, engine: PetraEngine, clock: int) -> None:
        """``clock`` finished: its messages arrived, every stage is between two clocks."""

    def window_end(self, engine: PetraEngine, window: Window) -> None:
        """The window's clocks ran and the loss was reduced, on every rank (collectives are safe here)."""

    def before_instruction(self, engine: PetraEngine, instruction: Any) -> None:
        """The engine is about to execute ``instruction`` (one of ``petra_ds.schedule.INSTRUCTIONS``), in
        training and in ``eval_batch``: what measuring a clock action by action needs."""

    def after_instruction(self, engine: PetraEngine, instruction: Any) -> None:
        """The engine executed ``instruction``."""


HOOKS = tuple(name for name in vars(Observer) if not name.startswith("_"))


def hook_table(observers: Sequence[Observer]) -> dict[str, tuple[Callable, ...]]:
    """Per hook, the bound methods of the observers that override it, in registration order: the engine
    calls only those, so a hook nobody watches costs one lookup per clock, not a call per observer."""
    return {hook: tuple(getattr(o, hook) for o in observers if getattr(type(o), hook) is not getattr(Observer, hook))
            for hook in HOOKS}


class Callbacks(Observer):
    """``engine.step_observers`` (``f(stage_index, stage)`` before each step) and
    ``engine.clock_observers`` (``f(engine, clock)`` at each clock's end), as one observer."""

    def __init__(self) -> None:
        self.steps: list[Callable[[int, "Stage"], None]] = []
        self.clocks: list[Callable[[Any, int], None]] = []

    def before_step(self, engine: PetraEngine, stage: int, step: int) -> None:
        for observe in self.steps:
            observe(stage, engine.stages[stage])

    def clock_end(self, engine: PetraEngine, clock: int) -> None:
        for observe in self.clocks:
            observe(engine, clock)


@dataclass(frozen=True)
class Holdings:
    """What one stage keeps alive between two clocks beyond its model and optimizer, by category
    (references to the engine's and the stage's own containers, never copies). The memory ledger
    (``engine.memory_report``) and the held-bytes tracker (``petra_ds.diagnostics.held``) both count this
    one view.

    - ``data``: stage 0's raw micro-batches, and those loaded but not yet run;
    - ``inputs``: a non-reversible stage's exact inputs (its FIFO) on the device;
    - ``outputs``: what a clock keeps inside itself (the last stage's graph, a reconstruction's tape);
      empty between clocks;
    - ``param_stash``: the weight-stashing ablation's parameters;
    - ``graphs``: the static tensors of the stage's CUDA graphs (``cuda_graphs``: inputs, outputs, gradients; the
      intermediates in the graphs' own memory pools are ``memory_report``'s ``graph_pools``);
    - ``messages``: messages received for, or produced by, this stage and not yet consumed;
    - ``offloaded``: the host copies of the FIFO entries and stage 0's micro-batches offloaded (``fifo_offload``);
    - ``messages_host``: the host copies of messages for this stage parked by ``message_offload``.
      The last two are host memory, not the stage's device: outside :meth:`categories`, which lists what the stage
      keeps where it computes.
    """

    data: tuple
    inputs: tuple
    outputs: tuple
    param_stash: tuple
    messages: tuple
    offloaded: tuple = ()
    messages_host: tuple = ()
    graphs: tuple = ()

    def categories(self) -> dict[str, Any]:
        return {"data": self.data, "inputs": self.inputs, "outputs": self.outputs,
                "param_stash": self.param_stash, "messages": self.messages, "graphs": self.graphs}

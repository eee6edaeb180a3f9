"""PETRA's schedule as data.

The clock equations (README, "The PETRA clock, exactly") live in the three functions below and nowhere else:
micro-batch ``m`` enters stage 0 at clock ``m``; at stage ``j`` of ``J`` its forward runs at clock
``m + j`` and its backward ``2(J-1-j)`` clocks later; the last stage does forward, loss and backward in
one clock. :class:`PetraSchedule` turns them into DeepSpeed ``PipeInstruction`` lists, one list per
clock, for a pipeline rank that hosts ``stages_per_rank`` consecutive stages; ``petra_ds.replay``
replays the lists of every rank and checks them without torch.distributed.

Within a clock a rank loads data, runs its forwards, posts the activations it sends and receives in
this clock as one batch (``PostP2P("act")``), runs its backwards (all with the parameters as they were
when the clock began) and posts the gradients' batch (``PostP2P("grad")``), steps the optimizers that are
due, and at its ``CommitP2P`` posts the tied weights' batch and waits for all of this clock's messages:
a message travels exactly one clock, its transfer overlaps the rest of the clock, and a window of clocks
leaves nothing half-sent behind it. One batch per (clock, phase), in that order on every rank, is what
makes the traffic safe under NCCL's rules (see ``petra_ds.transport``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from deepspeed.runtime.pipe.schedule import CommitP2P, PipeInstruction, PipeSchedule

from . import keys

__all__ = [
    "AccumulateAndStep",
    "CommitP2P",
    "DelayedBackward",
    "EvalForward",
    "EvalSchedule",
    "FeedLog",
    "ForwardPass",
    "LoadMicroBatch",
    "PetraSchedule",
    "PostP2P",
    "RecvActivation",
    "RecvGrad",
    "ReverseReconstruct",
    "SendActivation",
    "SendGrad",
    "Timeline",
    "Window",
    "backward_micro_batch",
    "delay",
    "forward_micro_batch",
    "reconstructs",
]


# --- the PETRA clock (README, "The PETRA clock, exactly") ----------------------------------------


def forward_micro_batch(clock: int, stage: int) -> int:
    """The micro-batch whose forward stage ``stage`` runs at ``clock``."""
    return clock - stage


def backward_micro_batch(clock: int, stage: int, num_stages: int) -> int:
    """The micro-batch whose backward stage ``stage`` runs at ``clock``."""
    return clock - 2 * (num_stages - 1) + stage


def delay(stage: int, num_stages: int) -> int:
    """tau_j: clocks between a micro-batch's forward and its backward at ``stage``."""
    return 2 * (num_stages - 1 - stage)


def first_stage_lateness(num_stages: int, k: int) -> str | None:
    """A warning when stage 0 applies its gradients more than one optimizer step after their forward
    (tau_0 / k > 1): at a high learning rate that delay, more than any compensation, decides how far PETRA
    trails backprop. None otherwise."""
    behind = delay(0, num_stages) / k
    if behind <= 1:
        return None
    need = delay(0, num_stages)
    return (f"PETRA: stage 0 applies its gradients {behind:g} optimizer steps after its forward (J = {num_stages} "
            f"stages, k = {k} micro-batches per step); at a high learning rate this costs quality. Keep the global "
            f"batch and split it into at least {need} micro-batches per step (\"gradient_accumulation_steps\": "
            f"{need}, the micro-batch made smaller to match; the examples do it with --global-batch N), or train "
            "with an optimizer that tolerates the delay (DeepSpeed's \"muon\")")


def reconstructs(stage: int, num_stages: int, reversible: bool, input_buffer: str = "non_reversible") -> bool:
    """Whether ``stage`` rebuilds its input by inversion instead of keeping it: a reversible middle
    stage, unless ``input_buffer="all"`` keeps every input. Stage 0 re-reads its data and the last stage
    keeps its graph within the clock, so neither does. The schedule (and through it the engine), the
    replay, the timeline, the partition and the stage all ask this function."""
    return 0 < stage < num_stages - 1 and reversible and input_buffer != "all"


# --- which micro-batches exist -------------------------------------------------------------------


@dataclass(frozen=True)
class FeedLog:
    """The micro-batches fed to stage 0, as sorted half-open index intervals.

    Micro-batch ``m`` enters at clock ``m``; a clock that feeds nothing (a drain, a short batch) leaves
    a hole in the numbering, so indices stay equal to entry clocks and the equations above stay exact.
    """

    intervals: tuple[tuple[int, int], ...] = ()

    def fed(self, m: int) -> bool:
        return any(lo <= m < hi for lo, hi in self.intervals)

    def ordinal(self, m: int) -> int:
        """How many fed micro-batches have an index ``<= m`` (1 for the first one fed)."""
        return sum(max(0, min(hi, m + 1) - lo) for lo, hi in self.intervals)

    @property
    def total(self) -> int:
        return sum(hi - lo for lo, hi in self.intervals)

    @property
    def last(self) -> int | None:
        return self.intervals[-1][1] - 1 if self.intervals else None

    def feed(self, start: int, count: int) -> "FeedLog":
        """This log plus ``count`` micro-batches entering at clocks ``start, start+1, ...``."""
        if count < 0:
            raise ValueError(f"cannot feed {count} micro-batches")
        if count == 0:
            return self
        if self.last is not None and start <= self.last:
            raise ValueError(f"micro-batch {start} would enter before the last one fed ({self.last})")
        intervals = list(self.intervals)
        if intervals and intervals[-1][1] == start:
            intervals[-1] = (intervals[-1][0], start + count)
        else:
            intervals.append((start, start + count))
        return FeedLog(tuple(intervals))

    def drained_at(self, num_stages: int) -> int:
        """The first clock at which no fed micro-batch has a backward still to run."""
        return 0 if self.last is None else self.last + delay(0, num_stages) + 1


# --- instructions --------------------------------------------------------------------------------


class PetraInstruction(PipeInstruction):
    """An instruction about one micro-batch at one PETRA stage."""

    def __init__(self, stage: int, micro_batch: int, **kwargs) -> None:
        super().__init__(stage=stage, micro_batch=micro_batch, **kwargs)


class LoadMicroBatch(PetraInstruction):
    """Stage 0 reads the next (inputs, labels) from the data iterator.

    Only stage 0 reads data: the labels travel with the activations to the last stage, so a rank that
    does not host stage 0 never touches the iterator (DeepSpeed's 1F1B has the last stage read its
    own copy, which cannot line up with PETRA's delays across ``train_batch`` calls and drains).
    Stage 0 keeps the raw micro-batch until its backward: it is data, not an activation buffer.
    """


class ForwardPass(PetraInstruction):
    """x_j = F_j(x_{j-1}; theta_j). Non-reversible stages push their exact input on their FIFO; the
    last stage computes the loss and keeps its graph for the backward in the same clock."""


class EvalForward(PetraInstruction):
    """F_j(x) with the current parameters, no graph and no training state touched (``eval_batch``);
    the last stage computes the loss and keeps the outputs when asked."""


class ReverseReconstruct(PetraInstruction):
    """x~_{j-1} = F_j^{-1}(x~_j; theta_j) with the current parameters, building the graph of F_j on the
    way (reversible stages only)."""


class DelayedBackward(PetraInstruction):
    """delta_j = d_x F_j^T delta_{j+1} and Delta_j += d_theta F_j^T delta_{j+1}, on the reconstructed
    graph, the recomputed one (non-reversible stages, from the FIFO or the raw micro-batch) or the
    live one (last stage)."""


class AccumulateAndStep(PipeInstruction):
    """The stage's k-th backward since its last step: reduce Delta_j inside the stage's data-parallel
    group, optimizer step, zero, scheduler step. ``step`` counts the stage's optimizer steps from 1."""

    def __init__(self, stage: int, step: int) -> None:
        super().__init__(stage=stage, step=step)


class SendActivation(PetraInstruction):
    """Queue x_j (output of ``stage``'s forward of ``micro_batch``) and the labels for stage j+1."""


class RecvActivation(PetraInstruction):
    """Queue the receive of x_{j-1} for ``stage``'s forward of ``micro_batch`` at the next clock."""


class SendGrad(PetraInstruction):
    """Queue delta_j (and x~_{j-1} when ``with_input``: stage j-1 reconstructs) for stage j-1."""

    def __init__(self, stage: int, micro_batch: int, with_input: bool) -> None:
        super().__init__(stage=stage, micro_batch=micro_batch, with_input=with_input)


class RecvGrad(PetraInstruction):
    """Queue the receive of delta_{j+1} (and x~_j when ``with_input``) for ``stage``'s backward of
    ``micro_batch`` at the next clock."""

    def __init__(self, stage: int, micro_batch: int, with_input: bool) -> None:
        super().__init__(stage=stage, micro_batch=micro_batch, with_input=with_input)


class PostP2P(PipeInstruction):
    """Issue the sends and receives queued since the last post as one batch: ``phase`` "act" after the
    clock's forwards, "grad" after its backwards (the tied weights go with the ``CommitP2P``)."""

    def __init__(self, phase: str) -> None:
        super().__init__(phase=phase)


class SendTiedGrad(PipeInstruction):
    """A reader of tied weights sends the gradient it accumulated for its step ``step`` to the owner."""

    def __init__(self, stage: int, owner: int, key: str, step: int) -> None:
        super().__init__(stage=stage, owner=owner, key=key, step=step)


class RecvTiedGrad(PipeInstruction):
    """The owner of tied weights receives ``reader``'s gradient for step ``step`` (it steps later)."""

    def __init__(self, stage: int, reader: int, key: str, step: int) -> None:
        super().__init__(stage=stage, reader=reader, key=key, step=step)


class SendTiedWeight(PipeInstruction):
    """The owner sends the tied weights of its step ``step`` to ``reader``."""

    def __init__(self, stage: int, reader: int, key: str, step: int) -> None:
        super().__init__(stage=stage, reader=reader, key=key, step=step)


class RecvTiedWeight(PipeInstruction):
    """A reader receives the owner's weights of step ``step``; they replace its copy from the next clock."""

    def __init__(self, stage: int, owner: int, key: str, step: int) -> None:
        super().__init__(stage=stage, owner=owner, key=key, step=step)


# --- the schedule --------------------------------------------------------------------------------


class PetraSchedule(PipeSchedule):
    """Instructions of pipeline rank ``stage_id`` for clocks ``[start_clock, start_clock + clocks)``.

    ``stages`` and ``stage_id`` keep DeepSpeed's meaning (pipeline ranks, this rank); the rank hosts
    PETRA stages ``stage_id * stages_per_rank ...`` up to the next rank's first. ``micro_batches`` is
    the number fed in this window (``feed`` already lists them); ``reversible[j]`` says whether stage
    ``j``'s layers are reversible, and :func:`reconstructs` with ``input_buffer`` whether it rebuilds its
    input instead of keeping it. ``ties`` lists ``(key, owner, readers)`` of the
    tied weights shared across stages (see ``petra_ds.module.Tie``): a reader sends its gradient at
    its step, the owner sends its new weights at its step.
    """

    def __init__(
        self,
        micro_batches: int,
        stages: int,
        stage_id: int,
        *,
        feed: FeedLog,
        start_clock: int,
        clocks: int | None = None,
        stages_per_rank: int = 1,
        gradient_accumulation_steps: int = 1,
        reversible: Sequence[bool] | None = None,
        ties: Sequence[tuple[str, int, Sequence[int]]] = (),
        input_buffer: str = "non_reversible",
    ) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.ties = [(key, owner, tuple(readers)) for key, owner, readers in ties]
        if stages_per_rank < 1:
            raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        self.num_petra_stages = stages * stages_per_rank
        self.local_stages = range(stage_id * stages_per_rank, (stage_id + 1) * stages_per_rank)
        self.feed = feed
        self.start_clock = start_clock
        self.clocks = micro_batches if clocks is None else clocks
        self.k = gradient_accumulation_steps
        reversible = (False,) * self.num_petra_stages if reversible is None else tuple(reversible)
        if len(reversible) != self.num_petra_stages:
            raise ValueError(f"reversible has {len(reversible)} entries for {self.num_petra_stages} stages")
        self.reversible = reversible
        self.input_buffer = input_buffer

    @classmethod
    def for_window(cls, window: "Window", stages: int, stage_id: int, **kwargs) -> "PetraSchedule":
        return cls(window.micro_batches, stages, stage_id, feed=window.feed,
                   start_clock=window.start_clock, clocks=window.clocks, **kwargs)

    def reconstructs(self, stage: int) -> bool:
        return reconstructs(stage, self.num_petra_stages, self.reversible[stage], self.input_buffer)

    def forward_at(self, clock: int, stage: int) -> int | None:
        m = forward_micro_batch(clock, stage)
        return m if self.feed.fed(m) else None

    def backward_at(self, clock: int, stage: int) -> int | None:
        m = backward_micro_batch(clock, stage, self.num_petra_stages)
        return m if self.feed.fed(m) else None

    def step_at(self, clock: int, stage: int) -> int | None:
        """The optimizer step ``stage`` takes at ``clock`` (after its k-th backward since the last), if any."""
        m = self.backward_at(clock, stage)
        if m is None or self.feed.ordinal(m) % self.k:
            return None
        return self.feed.ordinal(m) // self.k

    def tied_messages(self, clock: int) -> list[PipeInstruction]:
        """Sends, then receives, in (tie, reader) order on every rank, so that the messages between two
        ranks pair up in the same order on both sides."""
        local = self.local_stages
        sends: list[PipeInstruction] = []
        recvs: list[PipeInstruction] = []
        for key, owner, readers in self.ties:
            for reader in readers:
                step = self.step_at(clock, reader)
                if step is not None:
                    if reader in local:
                        sends.append(SendTiedGrad(stage=reader, owner=owner, key=key, step=step))
                    if owner in local:
                        recvs.append(RecvTiedGrad(stage=owner, reader=reader, key=key, step=step))
        for key, owner, readers in self.ties:
            step = self.step_at(clock, owner)
            if step is None:
                continue
            for reader in readers:
                if owner in local:
                    sends.append(SendTiedWeight(stage=owner, reader=reader, key=key, step=step))
                if reader in local:
                    recvs.append(RecvTiedWeight(stage=reader, owner=owner, key=key, step=step))
        return sends + recvs

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for clock in range(self.start_clock, self.start_clock + self.clocks):
            yield self.clock_instructions(clock)

    def clock_instructions(self, clock: int) -> list[PipeInstruction]:
        """One clock of this rank, in the order the engine runs it: the forwards, then every activation
        this rank sends or receives in this clock, posted as one batch; the backwards, then the gradients'
        batch; the optimizer steps, the tied-weight messages, and a ``CommitP2P`` that posts those and waits
        for all of them. Receives are for the inputs of the next clock."""
        last = self.num_petra_stages - 1
        local = self.local_stages
        cmds: list[PipeInstruction] = []
        m = self.forward_at(clock, 0)
        if 0 in local and m is not None:
            cmds.append(LoadMicroBatch(stage=0, micro_batch=m))
        posts = False
        for stage in local:
            m = self.forward_at(clock, stage)
            if m is not None:
                cmds.append(ForwardPass(stage=stage, micro_batch=m))
                if stage < last:
                    cmds.append(SendActivation(stage=stage, micro_batch=m))
        for stage in local:
            m = self.forward_at(clock + 1, stage)
            if m is not None and stage > 0:
                cmds.append(RecvActivation(stage=stage, micro_batch=m))
        if any(isinstance(c, (SendActivation, RecvActivation)) for c in cmds):
            cmds.append(PostP2P(keys.ACT))
            posts = True
        grads: list[PipeInstruction] = []
        for stage in reversed(local):
            m = self.backward_at(clock, stage)
            if m is None:
                continue
            if self.reconstructs(stage):
                grads.append(ReverseReconstruct(stage=stage, micro_batch=m))
            grads.append(DelayedBackward(stage=stage, micro_batch=m))
            if stage > 0:
                grads.append(SendGrad(stage=stage, micro_batch=m, with_input=self.reconstructs(stage - 1)))
        for stage in local:
            m = self.backward_at(clock + 1, stage)
            if m is not None and stage < last:
                grads.append(RecvGrad(stage=stage, micro_batch=m, with_input=self.reconstructs(stage)))
        cmds.extend(grads)
        if any(isinstance(c, (SendGrad, RecvGrad)) for c in grads):
            cmds.append(PostP2P(keys.GRAD))
            posts = True
        for stage in local:
            step = self.step_at(clock, stage)
            if step is not None:
                cmds.append(AccumulateAndStep(stage=stage, step=step))
        tied = self.tied_messages(clock)
        cmds.extend(tied)
        if posts or tied:
            cmds.append(CommitP2P())
        return cmds

    def num_pipe_buffers(self) -> int:
        """The deepest input FIFO this rank can hold: tau_j + 1 micro-batches at its first stage."""
        return delay(self.local_stages[0], self.num_petra_stages) + 1


class EvalSchedule(PipeSchedule):
    """Forward-only clocks of ``eval_batch`` for pipeline rank ``stage_id``, as DeepSpeed's
    ``InferenceSchedule`` is for its pipeline: evaluation micro-batch ``m`` runs at stage ``j`` at clock
    ``m + j`` (the same equation as training), its activation goes on an ``"eval"`` channel and arrives
    within the clock. Training micro-batches in flight are not touched."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, stages_per_rank: int = 1) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.num_petra_stages = stages * stages_per_rank
        self.local_stages = range(stage_id * stages_per_rank, (stage_id + 1) * stages_per_rank)

    def _micro_batch(self, clock: int, stage: int) -> int | None:
        m = forward_micro_batch(clock, stage)
        return m if 0 <= m < self.micro_batches else None

    def steps(self) -> Iterator[list[PipeInstruction]]:
        last = self.num_petra_stages - 1
        for clock in range(self.micro_batches + last):
            cmds: list[PipeInstruction] = []
            for stage in self.local_stages:
                m = self._micro_batch(clock, stage)
                if m is None:
                    continue
                if stage == 0:
                    cmds.append(LoadMicroBatch(stage=0, micro_batch=m))
                cmds.append(EvalForward(stage=stage, micro_batch=m))
                if stage < last:
                    cmds.append(SendActivation(stage=stage, micro_batch=m, kind=keys.EVAL))
            for stage in self.local_stages:
                m = self._micro_batch(clock + 1, stage)
                if m is not None and stage > 0:
                    cmds.append(RecvActivation(stage=stage, micro_batch=m, kind=keys.EVAL))
            if any(isinstance(c, (SendActivation, RecvActivation)) for c in cmds):
                cmds += [PostP2P(keys.EVAL), CommitP2P()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1


# --- the state that survives between windows -----------------------------------------------------


@dataclass(frozen=True)
class Window:
    """A run of clocks: ``train_batch`` (k clocks feeding up to k micro-batches) or ``drain``."""

    start_clock: int
    clocks: int
    micro_batches: int
    feed: FeedLog


@dataclass
class Timeline:
    """Where the pipeline is between windows: the next clock and the micro-batches fed so far."""

    num_stages: int
    clock: int = 0
    feed: FeedLog = field(default_factory=FeedLog)

    def train_window(self, clocks: int, micro_batches: int | None = None) -> Window:
        """``clocks`` clocks feeding ``micro_batches`` (default: one per clock) from the first one."""
        micro_batches = clocks if micro_batches is None else micro_batches
        if not 0 <= micro_batches <= clocks:
            raise ValueError(f"cannot feed {micro_batches} micro-batches in {clocks} clocks")
        return Window(self.clock, clocks, micro_batches, self.feed.feed(self.clock, micro_batches))

    def drain_window(self) -> Window:
        """The clocks, with no new data, until every fed micro-batch had its backward everywhere."""
        clocks = max(0, self.feed.drained_at(self.num_stages) - self.clock)
        return Window(self.clock, clocks, 0, self.feed)

    def advance(self, window: Window) -> None:
        if window.start_clock != self.clock:
            raise ValueError(f"window starts at clock {window.start_clock}, timeline is at {self.clock}")
        self.clock += window.clocks
        self.feed = window.feed

    @property
    def in_flight(self) -> bool:
        return self.clock < self.feed.drained_at(self.num_stages)

"""PETRA's schedule as data.

:class:`PetraSchedule` turns the clock equations (``clock.py``) into DeepSpeed ``PipeInstruction``
lists, one list per clock, for a pipeline rank that hosts ``stages_per_rank`` consecutive stages;
``petra_ds.verify.replay`` replays the lists of every rank and checks them without torch.distributed.

Within a clock a rank loads data, runs its forwards, posts the activations it sends and receives in
this clock as one batch (``PostP2P("act")``), runs its backwards (all with the parameters as they were
when the clock began) and posts the gradients' batch (``PostP2P("grad")``), steps the optimizers that are
due, and at its ``CommitP2P`` posts the tied weights' batch and waits for all of this clock's messages:
a message travels exactly one clock, its transfer overlaps the rest of the clock, and a window of clocks
leaves nothing half-sent behind it. One batch per (clock, phase), in that order on every rank, is what
makes the traffic safe under NCCL's rules (see ``petra_ds.runtime.transport``).
"""

from __future__ import annotations

from typing import Callable, Container, Iterator, Sequence

from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule

from ..util.checks import positive_int
from . import channels
from .channels import Key
from .clock import backward_micro_batch, delay, forward_micro_batch, reconstructs
from .instructions import (AccumulateAndStep, CommitP2P, ComputeInstruction, DelayedBackward, EvalForward,
                           ForwardPass, LoadMicroBatch, PostP2P, RecvActivation, RecvGrad, RecvTiedGrad, RecvTiedWeight,
                           ReverseReconstruct, SendActivation, SendGrad, SendTiedGrad, SendTiedWeight)
from .progress import FedMicroBatches, Window


def with_messages(compute: Sequence[ComputeInstruction], consumers_next: Sequence[ComputeInstruction],
                  consumers_of: Callable[[Key], Sequence[ComputeInstruction]],
                  local: Container[int]) -> list[PipeInstruction]:
    """``compute`` with its messages, derived from what each instruction produces and consumes (one pass, as
    torch.distributed.pipelining adds its sends and receives): a send after each instruction that produces
    a message, then a receive for each message ``consumers_next`` (this rank's compute of the same phase at
    the next clock) consumes from a stage not in ``local`` (this rank's): a message between two stages of the
    rank is handed over in memory at the commit, with nothing to receive. ``consumers_of(key)`` is the receiving
    stage's compute at the next clock: a gradient carries x~ when its consumer reconstructs. Loaded data
    (``channels.DATA``) is never sent."""
    cmds: list[PipeInstruction] = []
    for c in compute:
        cmds.append(c)
        key = c.produces
        if key is None or key.kind == channels.DATA:
            continue
        if key.kind == channels.GRAD:
            takers = [t for t in consumers_of(key) if t.consumes == key]
            cmds.append(SendGrad(c.stage, c.micro_batch, with_input=isinstance(takers[0], ReverseReconstruct)))
        else:
            cmds.append(SendActivation(c.stage, c.micro_batch, **_kind(key.kind)))
    for c in consumers_next:
        key = c.consumes
        if key is None or key.kind == channels.DATA:
            continue
        if key.kind == channels.GRAD:
            recv = RecvGrad(c.stage, c.micro_batch, with_input=isinstance(c, ReverseReconstruct))
        else:
            recv = RecvActivation(c.stage, c.micro_batch, **_kind(key.kind))
        if recv.channel().src not in local:
            cmds.append(recv)
    return cmds


def forward_compute(forward: type[ComputeInstruction], stage: int, m: int, petra_stages: int,
                    kind: str) -> list[ComputeInstruction]:
    """A forward of micro-batch ``m`` at ``stage`` (``ForwardPass`` or ``EvalForward``) with what it consumes and
    produces: stage 0 loads its micro-batch first and consumes it, any other stage the previous stage's
    ``kind`` activation; every stage but the last produces its own."""
    load = [LoadMicroBatch(0, m, produces=channels.data_key(m))] if stage == 0 else []
    x = channels.data_key(m) if stage == 0 else channels.forward_key(stage - 1, m, kind)
    out = None if stage == petra_stages - 1 else channels.forward_key(stage, m, kind)
    return load + [forward(stage, m, consumes=x, produces=out)]


def _kind(kind: str) -> dict[str, str]:
    """An activation message's ``kind`` keyword (none for training's, the instructions' default)."""
    return {} if kind == channels.ACT else {"kind": kind}


class Clock(list):
    """One clock's instructions of one rank, in order, and where its forward phase ends: the instructions
    before ``forwards_end`` load, run forwards and post their activations (the engine tells its observers
    there, ``Observer.forwards_done``)."""

    def __init__(self, instructions: Sequence[PipeInstruction] = (), forwards_end: int = 0) -> None:
        super().__init__(instructions)
        self.forwards_end = forwards_end


class ClockTemplates(dict):
    """Steady clocks already derived, kept across windows by whoever runs them (the engine): a clock whose every
    micro-batch of the clock equations lies inside one run of fed micro-batches is the clock ``k`` clocks earlier
    shifted by ``k`` micro-batches and one optimizer step, so a rank derives one clock per phase of its steps and
    shifts it from then on, at a third of the host's bytecodes and time per clock (J = 10 stages in one process:
    0.33x the bytecodes, 0.27x the time of a window on a CPU). Keyed by (phase, whether the next clock feeds)."""


def shifted(template: Sequence[tuple], micro_batches: int, steps: int) -> list[PipeInstruction]:
    """The instructions of a clock's :func:`template`, for the micro-batches ``micro_batches`` later and the optimizer
    steps ``steps`` later: each the same instruction as the schedule would build it then (its micro-batch, step and
    message keys moved)."""
    out = []
    for cls, attrs, kwargs, m, consumes, produces, step in template:
        kwargs = kwargs.copy()
        if m is not None:
            kwargs["micro_batch"] = m + micro_batches
            if consumes is not None:  # a compute instruction's keys, indexed by micro-batch
                kwargs["consumes"] = _new_key(Key, (consumes[0], consumes[1], consumes[2] + micro_batches))
            if produces is not None:
                kwargs["produces"] = _new_key(Key, (produces[0], produces[1], produces[2] + micro_batches))
        if step is not None:
            kwargs["step"] = step + steps
        copy = _new_instruction(cls)
        copy.__dict__ = {**attrs, **kwargs, "kwargs": kwargs}
        out.append(copy)
    return out


def template(cmds: Sequence[PipeInstruction]) -> tuple[tuple, ...]:
    """What :func:`shifted` needs of each instruction of a clock, read once: its class, its attributes that are not
    keywords, its keywords, and the micro-batch, message keys and step it moves."""
    return tuple((type(c), {k: v for k, v in vars(c).items() if k not in c.kwargs}, c.kwargs,
                  c.kwargs.get("micro_batch"), c.kwargs.get("consumes"), c.kwargs.get("produces"), c.kwargs.get("step"))
                 for c in cmds)


#: a :class:`Key` made from its fields without the named tuple's Python-level constructor
_new_key = tuple.__new__
#: an instruction made without its constructor (:func:`shifted` sets its attributes)
_new_instruction = object.__new__


class PetraSchedule(PipeSchedule):
    """Instructions of pipeline rank ``stage_id`` for clocks ``[start_clock, start_clock + clocks)``.

    ``stages`` and ``stage_id`` keep DeepSpeed's meaning (pipeline ranks, this rank); the rank hosts
    PETRA stages ``stage_id * stages_per_rank ...`` up to the next rank's first. ``micro_batches`` is
    the number fed in this window (``feed`` already lists them); ``reversible[j]`` says whether stage
    ``j``'s layers are reversible, and :func:`reconstructs` with ``input_buffer`` whether it rebuilds its
    input instead of keeping it. ``ties`` lists ``(key, owner, readers)`` of the
    tied weights shared across stages (see ``petra_ds.pipeline.module.Tie``): a reader sends its gradient at
    its step, the owner sends its new weights at its step. ``templates``: steady clocks derived by earlier
    windows of the same rank and arguments (:class:`ClockTemplates`), which this one reads and adds to.
    """

    def __init__(
        self,
        micro_batches: int,
        stages: int,
        stage_id: int,
        *,
        feed: FedMicroBatches,
        start_clock: int,
        clocks: int | None = None,
        stages_per_rank: int = 1,
        gradient_accumulation_steps: int = 1,
        reversible: Sequence[bool] | None = None,
        ties: Sequence[tuple[str, int, Sequence[int]]] = (),
        input_buffer: str = "non_reversible",
        templates: ClockTemplates | None = None,
    ) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.ties = [(key, owner, tuple(readers)) for key, owner, readers in ties]
        positive_int(stages_per_rank, "stages_per_rank")
        positive_int(gradient_accumulation_steps, "gradient_accumulation_steps")
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
        self.templates = templates
        self._computed: dict[tuple[int, int], tuple[list[ComputeInstruction], list[ComputeInstruction]]] = {}

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
        ranks pair up in the same order on both sides; no receive where both ends are on this rank."""
        local = self.local_stages
        sends: list[PipeInstruction] = []
        recvs: list[PipeInstruction] = []
        for key, owner, readers in self.ties:
            for reader in readers:
                step = self.step_at(clock, reader)
                if step is not None:
                    if reader in local:
                        sends.append(SendTiedGrad(stage=reader, owner=owner, tie=key, step=step))
                    if owner in local and reader not in local:
                        recvs.append(RecvTiedGrad(stage=owner, reader=reader, tie=key, step=step))
        for key, owner, readers in self.ties:
            step = self.step_at(clock, owner)
            if step is None:
                continue
            for reader in readers:
                if owner in local:
                    sends.append(SendTiedWeight(stage=owner, reader=reader, tie=key, step=step))
                if reader in local and owner not in local:
                    recvs.append(RecvTiedWeight(stage=reader, owner=owner, tie=key, step=step))
        return sends + recvs

    def compute(self, clock: int, stage: int) -> tuple[list[ComputeInstruction], list[ComputeInstruction]]:
        """``stage``'s compute at ``clock`` as (forward phase, backward phase), each instruction with what it
        consumes and produces: the one place that says where a stage's input and its gradient come from.
        Kept for the next clock, which asks again (a clock's receives are the next clock's inputs)."""
        found = self._computed.get((clock, stage))
        if found is None:
            if len(self._computed) > 4 * self.num_petra_stages:
                self._computed = {k: v for k, v in self._computed.items() if k[0] >= clock}
            found = self._computed[(clock, stage)] = self._compute(clock, stage)
        return found

    def _compute(self, clock: int, stage: int) -> tuple[list[ComputeInstruction], list[ComputeInstruction]]:
        last = self.num_petra_stages - 1
        forward: list[ComputeInstruction] = []
        backward: list[ComputeInstruction] = []
        m = self.forward_at(clock, stage)
        if m is not None:
            forward = forward_compute(ForwardPass, stage, m, self.num_petra_stages, channels.ACT)
        m = self.backward_at(clock, stage)
        if m is not None:
            delta = None if stage == last else channels.backward_key(stage + 1, m)
            if self.reconstructs(stage):
                backward.append(ReverseReconstruct(stage, m, consumes=delta))
                delta = None
            backward.append(DelayedBackward(stage, m, consumes=delta, produces=channels.backward_key(stage, m)
                                            if stage > 0 else None))
        return forward, backward

    def steps(self) -> Iterator[Clock]:
        for clock in range(self.start_clock, self.start_clock + self.clocks):
            yield self.clock_instructions(clock)

    def clock_instructions(self, clock: int) -> Clock:
        """One clock of this rank, in the order the engine runs it: the forwards, then every activation
        this rank sends or receives in this clock, posted as one batch; the backwards, then the gradients'
        batch; the optimizer steps, the tied-weight messages, and a ``CommitP2P`` that posts those and waits
        for all of them. Receives are for the inputs of the next clock."""
        steady = None if self.templates is None else self._steady(clock)
        if steady is None:
            return self._derive(clock)
        key, base = steady
        found = self.templates.get(key)
        if found is None:
            cmds = self._derive(clock)
            self.templates[key] = (clock, base, template(cmds), cmds.forwards_end)
            return cmds
        start, start_base, instructions, forwards_end = found
        later = clock - start
        return Clock(shifted(instructions, later, (later - base + start_base) // self.k), forwards_end)

    def _steady(self, clock: int) -> tuple[tuple[int, bool], int] | None:
        """For a clock whose micro-batches (``clock - 2(J-1)`` .. ``clock``, at any stage, and the next clock's)
        all lie in one run of fed micro-batches, its template's key and the ``base`` that makes a micro-batch's
        ordinal ``m - base``; None for any other clock (the pipeline fills or drains around it)."""
        before = 0
        for lo, hi in self.feed.intervals:
            if lo <= clock - delay(0, self.num_petra_stages) and clock < hi:
                base = lo - 1 - before
                return ((clock - base) % self.k, clock + 1 < hi), base
            before += hi - lo
        return None

    def _derive(self, clock: int) -> Clock:
        """:meth:`clock_instructions` from the clock equations."""
        now = [self.compute(clock, stage) for stage in self.local_stages]
        following = [self.compute(clock + 1, stage) for stage in self.local_stages]
        cmds = with_messages([c for f, _ in now for c in f], [c for f, _ in following for c in f],
                             lambda key: self.compute(clock + 1, key.stage)[0], self.local_stages)
        posts = len(cmds) > sum(len(f) for f, _ in now)
        if posts:
            cmds.append(PostP2P(channels.ACT))
        forwards_end = len(cmds)
        backwards = [c for _, b in reversed(now) for c in b]
        grads = with_messages(backwards, [c for _, b in following for c in b],
                              lambda key: self.compute(clock + 1, key.stage)[1], self.local_stages)
        cmds.extend(grads)
        if len(grads) > len(backwards):
            cmds.append(PostP2P(channels.GRAD))
            posts = True
        for stage in self.local_stages:
            step = self.step_at(clock, stage)
            if step is not None:
                cmds.append(AccumulateAndStep(stage=stage, step=step))
        tied = self.tied_messages(clock)
        cmds.extend(tied)
        if posts or tied:
            cmds.append(CommitP2P())
        return Clock(cmds, forwards_end)

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

    def compute(self, clock: int, stage: int) -> list[ComputeInstruction]:
        m = self._micro_batch(clock, stage)
        if m is None:
            return []
        return forward_compute(EvalForward, stage, m, self.num_petra_stages, channels.EVAL)

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for clock in range(self.micro_batches + self.num_petra_stages - 1):
            now = [c for stage in self.local_stages for c in self.compute(clock, stage)]
            cmds = with_messages(now, [c for stage in self.local_stages for c in self.compute(clock + 1, stage)],
                                 lambda key: self.compute(clock + 1, key.stage), self.local_stages)
            if len(cmds) > len(now):
                cmds += [PostP2P(channels.EVAL), CommitP2P()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1

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

from typing import Iterator, Sequence

from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule

from ..util.checks import positive_int
from . import channels
from .clock import backward_micro_batch, delay, forward_micro_batch, reconstructs
from .instructions import (AccumulateAndStep, CommitP2P, DelayedBackward, EvalForward, ForwardPass, LoadMicroBatch,
                           PostP2P, RecvActivation, RecvGrad, RecvTiedGrad, RecvTiedWeight, ReverseReconstruct,
                           SendActivation, SendGrad, SendTiedGrad, SendTiedWeight)
from .progress import FedMicroBatches, Window


class Clock(list):
    """One clock's instructions of one rank, in order, and where its forward phase ends: the instructions
    before ``forwards_end`` load, run forwards and post their activations (the engine tells its observers
    there, ``Observer.forwards_done``)."""

    def __init__(self, instructions: Sequence[PipeInstruction] = (), forwards_end: int = 0) -> None:
        super().__init__(instructions)
        self.forwards_end = forwards_end


class PetraSchedule(PipeSchedule):
    """Instructions of pipeline rank ``stage_id`` for clocks ``[start_clock, start_clock + clocks)``.

    ``stages`` and ``stage_id`` keep DeepSpeed's meaning (pipeline ranks, this rank); the rank hosts
    PETRA stages ``stage_id * stages_per_rank ...`` up to the next rank's first. ``micro_batches`` is
    the number fed in this window (``feed`` already lists them); ``reversible[j]`` says whether stage
    ``j``'s layers are reversible, and :func:`reconstructs` with ``input_buffer`` whether it rebuilds its
    input instead of keeping it. ``ties`` lists ``(key, owner, readers)`` of the
    tied weights shared across stages (see ``petra_ds.pipeline.module.Tie``): a reader sends its gradient at
    its step, the owner sends its new weights at its step.
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
                        sends.append(SendTiedGrad(stage=reader, owner=owner, tie=key, step=step))
                    if owner in local:
                        recvs.append(RecvTiedGrad(stage=owner, reader=reader, tie=key, step=step))
        for key, owner, readers in self.ties:
            step = self.step_at(clock, owner)
            if step is None:
                continue
            for reader in readers:
                if owner in local:
                    sends.append(SendTiedWeight(stage=owner, reader=reader, tie=key, step=step))
                if reader in local:
                    recvs.append(RecvTiedWeight(stage=reader, owner=owner, tie=key, step=step))
        return sends + recvs

    def steps(self) -> Iterator[Clock]:
        for clock in range(self.start_clock, self.start_clock + self.clocks):
            yield self.clock_instructions(clock)

    def clock_instructions(self, clock: int) -> Clock:
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
            cmds.append(PostP2P(channels.ACT))
            posts = True
        forwards_end = len(cmds)
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
            cmds.append(PostP2P(channels.GRAD))
            posts = True
        for stage in local:
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
                    cmds.append(SendActivation(stage=stage, micro_batch=m, kind=channels.EVAL))
            for stage in self.local_stages:
                m = self._micro_batch(clock + 1, stage)
                if m is not None and stage > 0:
                    cmds.append(RecvActivation(stage=stage, micro_batch=m, kind=channels.EVAL))
            if any(isinstance(c, (SendActivation, RecvActivation)) for c in cmds):
                cmds += [PostP2P(channels.EVAL), CommitP2P()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1

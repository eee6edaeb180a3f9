"""PETRA's instructions: what a rank runs in a clock, as DeepSpeed ``PipeInstruction`` objects.

Each class says, as data, what every executor needs to know about it: its ``phase`` in the clock, and for
a message its direction, the channel it travels on and its key in the receiving stage's inbox (``channels``).
A compute instruction carries what it ``consumes`` from its stage's inbox and what it ``produces`` for
another stage (message keys, or None): the schedule decides them once, from the clock equations, and
derives the sends and receives from them (``schedules.py``). The engine (``runtime/engine.py``), the replay
(``verify/replay.py``) and the time model (``perf/programs.py``) read these fields instead of each deciding
from the class or the stage. :data:`INSTRUCTIONS` lists them all: the engine has exactly one handler for
each, and only for these.
"""

from __future__ import annotations

from typing import Any, ClassVar

from deepspeed.runtime.pipe.schedule import PipeInstruction

from . import channels
from .channels import Channel, Key

#: the phases of a clock, in the order a rank runs them
LOAD, FORWARD, BACKWARD, STEP, TRANSFER = "load", "forward", "backward", "step", "transfer"


class Instruction(PipeInstruction):
    """A PETRA instruction: DeepSpeed's ``PipeInstruction`` (keyword arguments become attributes) plus
    the rules an executor reads."""

    #: where it runs in its clock
    phase: ClassVar[str] = TRANSFER
    #: a message: True for a send, False for a receive; None for everything else
    sends: ClassVar[bool | None] = None
    #: a gradient message: whether it carries x~ too (its receiver reconstructs)
    with_input: bool = False
    #: the PETRA stage it is about (None: the rank's posts and commits)
    stage: int | None = None

    def __init__(self, **kwargs: Any) -> None:
        """What ``PipeInstruction.__init__`` sets (``name``, ``kwargs``, each keyword an attribute), in one dict
        update instead of its loop: a rank builds every instruction of every clock anew."""
        self.name = type(self).__name__
        self.kwargs = kwargs
        self.__dict__.update(kwargs)

    def channel(self) -> Channel:
        """The link this message travels on."""
        raise TypeError(f"{self!r} carries no message")

    def key(self) -> Key:
        """The message's key in the receiving stage's inbox (a compute instruction: the message it takes)."""
        raise TypeError(f"{self!r} names no message")

    def payload(self, fields: tuple) -> tuple:
        """What a send puts on the wire of the fields its stage produced."""
        return fields


class PetraInstruction(Instruction):
    """An instruction about one micro-batch at one PETRA stage."""

    def __init__(self, stage: int, micro_batch: int, **kwargs: Any) -> None:
        super().__init__(stage=stage, micro_batch=micro_batch, **kwargs)


class ComputeInstruction(PetraInstruction):
    """A compute instruction: ``consumes`` is the key of what it takes from its stage's inbox (a message
    received at the previous clock, or stage 0's loaded micro-batch), ``produces`` the key of what it makes
    for another stage; None for nothing."""

    def __init__(self, stage: int, micro_batch: int, *, consumes: Key | None = None,
                 produces: Key | None = None) -> None:
        super().__init__(stage, micro_batch, consumes=consumes, produces=produces)


class LoadMicroBatch(ComputeInstruction):
    """Stage 0 reads the next (inputs, labels) from the data iterator into its inbox (``produces``: its
    ``channels.data_key``), for its forward in the same clock.

    Only stage 0 reads data: the labels travel with the activations to the last stage, so a rank that
    does not host stage 0 never touches the iterator (DeepSpeed's 1F1B has the last stage read its
    own copy, which cannot line up with PETRA's delays across ``train_batch`` calls and drains).
    Stage 0 keeps the raw micro-batch until its backward: it is data, not an activation buffer.
    """

    phase = LOAD


class ForwardPass(ComputeInstruction):
    """x_j = F_j(x_{j-1}; theta_j), x_{j-1} from ``consumes``; x_j with the labels to ``produces`` (None at
    the last stage). Non-reversible stages push their exact input on their FIFO; the last stage computes the
    loss and keeps its graph for the backward in the same clock."""

    phase = FORWARD


class EvalForward(ComputeInstruction):
    """F_j(x) with the current parameters, no graph and no training state touched (``eval_batch``);
    the last stage computes the loss and keeps the outputs when asked."""

    phase = FORWARD


class ReverseReconstruct(ComputeInstruction):
    """x~_{j-1} = F_j^{-1}(x~_j; theta_j) with the current parameters, building the graph of F_j on the
    way (reversible stages only); ``consumes`` (delta_{j+1}, x~_j) from the next stage."""

    phase = BACKWARD


class DelayedBackward(ComputeInstruction):
    """delta_j = d_x F_j^T delta_{j+1} and Delta_j += d_theta F_j^T delta_{j+1}; (delta_j, x~_{j-1}) to
    ``produces`` (None at stage 0). It ``consumes`` delta_{j+1} exactly when it recomputes F_j from an
    exact input (the FIFO of a non-reversible stage, stage 0's raw micro-batch); a reconstructing stage
    took delta_{j+1} with its reconstruction and the last stage has its live graph (``consumes`` None)."""

    phase = BACKWARD


class AccumulateAndStep(Instruction):
    """The stage's k-th backward since its last step: reduce Delta_j inside the stage's data-parallel
    group, optimizer step, zero, scheduler step. ``step`` counts the stage's optimizer steps from 1."""

    phase = STEP

    def __init__(self, stage: int, step: int) -> None:
        super().__init__(stage=stage, step=step)


class SendActivation(PetraInstruction):
    """Queue x_j (output of ``stage``'s forward of ``micro_batch``) and the labels for stage j+1
    (``kind="eval"``: an ``eval_batch`` activation)."""

    sends, kind = True, channels.ACT

    def channel(self) -> Channel:
        return channels.forward_channel(self.stage, self.kind)

    def key(self) -> Key:
        return channels.forward_key(self.stage, self.micro_batch, self.kind)


class RecvActivation(PetraInstruction):
    """Queue the receive of x_{j-1} for ``stage``'s forward of ``micro_batch`` at the next clock."""

    sends, kind = False, channels.ACT

    def channel(self) -> Channel:
        return channels.forward_channel(self.stage - 1, self.kind)

    def key(self) -> Key:
        return channels.forward_key(self.stage - 1, self.micro_batch, self.kind)


class SendGrad(PetraInstruction):
    """Queue delta_j (and x~_{j-1} when ``with_input``: stage j-1 reconstructs) for stage j-1."""

    sends = True

    def __init__(self, stage: int, micro_batch: int, with_input: bool) -> None:
        super().__init__(stage=stage, micro_batch=micro_batch, with_input=with_input)

    def channel(self) -> Channel:
        return channels.backward_channel(self.stage)

    def key(self) -> Key:
        return channels.backward_key(self.stage, self.micro_batch)

    def payload(self, fields: tuple) -> tuple:
        delta, x_tilde = fields
        return delta, x_tilde if self.with_input else None


class RecvGrad(PetraInstruction):
    """Queue the receive of delta_{j+1} (and x~_j when ``with_input``) for ``stage``'s backward of
    ``micro_batch`` at the next clock."""

    sends = False

    def __init__(self, stage: int, micro_batch: int, with_input: bool) -> None:
        super().__init__(stage=stage, micro_batch=micro_batch, with_input=with_input)

    def channel(self) -> Channel:
        return channels.backward_channel(self.stage + 1)

    def key(self) -> Key:
        return channels.backward_key(self.stage + 1, self.micro_batch)


class PostP2P(Instruction):
    """Issue the sends and receives queued since the last post as one batch: ``batch`` "act" after the
    clock's forwards, "grad" after its backwards, "eval" in ``eval_batch`` (the tied weights go with the
    ``CommitP2P``)."""

    def __init__(self, batch: str) -> None:
        super().__init__(batch=batch)


class CommitP2P(Instruction):
    """Post what is still queued, then wait for every message of the clock (a message travels exactly one
    clock). DeepSpeed's DualPipeV has an instruction of this name for its own batches; PETRA's engine
    runs only this one."""


class TiedMessage(Instruction):
    """A message of the tied weights ``tie`` for optimizer step ``step``, between their owner and one of its
    readers; the instruction's stage is one end, the keyword ``other_end`` (``owner`` or ``reader``) the other."""

    other_end: ClassVar[str]

    def __init__(self, stage: int, tie: str, step: int, **other_end: int) -> None:
        if set(other_end) != {self.other_end}:
            raise TypeError(f"{type(self).__name__} takes stage, {self.other_end}, tie and step")
        super().__init__(stage=stage, **other_end, tie=tie, step=step)

    def ends(self) -> tuple[int, int]:
        """(owner, reader) of the message."""
        return self.kwargs.get("owner", self.stage), self.kwargs.get("reader", self.stage)


class TiedGradMessage(TiedMessage):
    """A reader's gradient of its step, for the owner (who adds it before it steps)."""

    def channel(self) -> Channel:
        owner, reader = self.ends()
        return channels.tied_grad_channel(self.tie, reader, owner)

    def key(self) -> Key:
        owner, reader = self.ends()
        return channels.tied_grad_key(owner, self.tie, reader, self.step)


class TiedWeightMessage(TiedMessage):
    """The owner's weights after its step, for a reader (they replace its copy from the next clock)."""

    def channel(self) -> Channel:
        owner, reader = self.ends()
        return channels.tied_weight_channel(self.tie, owner, reader)

    def key(self) -> Key:
        return channels.tied_weight_key(self.ends()[1], self.tie, self.step)


class SendTiedGrad(TiedGradMessage):
    """A reader of tied weights ``tie`` sends the gradient it accumulated for its step ``step`` to ``owner``."""

    sends, other_end = True, "owner"


class RecvTiedGrad(TiedGradMessage):
    """The owner of tied weights ``tie`` receives ``reader``'s gradient for step ``step`` (it steps later)."""

    sends, other_end = False, "reader"


class SendTiedWeight(TiedWeightMessage):
    """The owner sends the tied weights ``tie`` of its step ``step`` to ``reader``."""

    sends, other_end = True, "reader"


class RecvTiedWeight(TiedWeightMessage):
    """A reader receives the owner's weights ``tie`` of step ``step``."""

    sends, other_end = False, "owner"


#: every instruction a PETRA schedule produces, each with exactly one handler in the engine
INSTRUCTIONS: tuple[type[Instruction], ...] = (
    LoadMicroBatch, ForwardPass, EvalForward, ReverseReconstruct, DelayedBackward, AccumulateAndStep,
    SendActivation, RecvActivation, SendGrad, RecvGrad, SendTiedGrad, RecvTiedGrad, SendTiedWeight,
    RecvTiedWeight, PostP2P, CommitP2P,
)

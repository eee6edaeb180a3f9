"""PETRA's schedule as data: the clock equations, the instructions, every rank's instruction lists and the
message keys. Pure data: nothing here touches a tensor or a process group."""

from . import channels
from .clock import backward_micro_batch, delay, first_stage_lateness, forward_micro_batch, kept_first, reconstructs
from .instructions import (INSTRUCTIONS, AccumulateAndStep, CommitP2P, DelayedBackward, EvalForward, ForwardPass,
                           LoadMicroBatch, PostP2P, RecvActivation, RecvGrad, RecvTiedGrad, RecvTiedWeight,
                           ReverseReconstruct, SendActivation, SendGrad, SendTiedGrad, SendTiedWeight)
from .schedules import Clock, ClockTemplates, EvalSchedule, PetraSchedule
from .progress import FedMicroBatches, Timeline, Window

__all__ = [
    "INSTRUCTIONS", "AccumulateAndStep", "Clock", "ClockTemplates", "CommitP2P", "DelayedBackward", "EvalForward",
    "EvalSchedule", "FedMicroBatches", "ForwardPass", "LoadMicroBatch", "PetraSchedule", "PostP2P", "RecvActivation",
    "RecvGrad", "RecvTiedGrad", "RecvTiedWeight", "ReverseReconstruct", "SendActivation", "SendGrad", "SendTiedGrad",
    "SendTiedWeight", "Timeline", "Window", "backward_micro_batch", "delay", "first_stage_lateness",
    "forward_micro_batch", "channels", "kept_first", "reconstructs",
]

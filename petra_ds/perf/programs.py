"""The pipeline schedules lowered into the simulator's programs: the one place that says what each
instruction costs and how it communicates.

Communication, as the engines do it:

- PETRA: sends and receives are posted (non-blocking) by the ``PostP2P`` after them (the activations'
  batch after the forwards, the gradients' after the backwards) or the clock's ``CommitP2P``, which waits
  for all of them; a transfer takes ``message_s`` once both sides are posted (a gradient that carries
  the reconstructed input x~ is two messages);
- DeepSpeed: every ``Send*``/``Recv*`` is a blocking p2p call, matched in order on its channel;
- both: ``train_batch`` ends with the loss broadcast from the last stage, which the others wait for.
- torch.distributed.pipelining (``torch_programs``): sends and receives are posted (isend/irecv) where
  the schedule says, a receive is waited for right before the compute that uses it, a send where the
  schedule waits for it; ``step()`` ends without a collective.

Cost of an instruction, per stage (``forward``: without a graph, ``forward_grad``: keeping the graph,
``backward``: through a kept graph, ``step``: optimizer step):

==========================  =====================================================================
PETRA, stage j < J-1        ForwardPass = forward; ReverseReconstruct, or the recomputation inside
                            DelayedBackward of a non-reversible stage (stage 0 included) = forward_grad;
                            DelayedBackward = backward; AccumulateAndStep = step
PETRA, last stage           ForwardPass = forward_grad (with the loss); DelayedBackward = backward
1F1B, GPipe, naive MP       ForwardPass = forward_grad; BackwardPass = backward (``backward_split`` at
                            a non-last stage when measured: DeepSpeed's engine runs one backward call
                            per output tensor); OptimizerStep = step
``*_ckpt`` (checkpointing)  ForwardPass = forward_grad (DeepSpeed's and torch's non-reentrant checkpoint
                            run the forward with autograd on, only dropping what it saves: measured
                            0.083-0.090 s vs forward_grad 0.085 and forward 0.070 on the RevGPT stage);
                            BackwardPass = forward_grad + backward (both scaled by backward_split /
                            backward where measured)
``*_rev`` (reversible       at the reversible stages ForwardPass = forward (no graph) and BackwardPass =
backprop)                   forward_grad + backward (they reconstruct their input); the plain variant
                            at the others (they store their activations)
single process              forward_grad + backward of every stage per micro-batch, their steps / k
``torch_*`` (torch's        one rank per stage (J ranks). The two-chunk schedules (interleaved 1F1B and
pipelining)                 zero bubble, ZBV, DualPipeV) run 2J virtual stages: stage j's layers cut in
                            halves, virtual stages 2j and 2j+1, each costing half of stage j's costs;
                            interleaved: virtual v on rank v mod J, V-shaped: v and 2J-1-v on rank v.
                            F = forward_grad (the last one's with the loss); full backward B = backward
                            (one call over all outputs: never ``backward_split``); split backward: I
                            (input gradient) = ``INPUT_GRAD_SHARE`` x backward, W (weight gradient) = the
                            rest; step = the step of the rank's halves
``torch_*_ckpt``            F = forward_grad (as ``*_ckpt`` above); a recompute (forward_grad) before
                            each B or I, none before W (it reuses the graph I rebuilt)
==========================  =====================================================================
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator, Sequence

from deepspeed.runtime.pipe import schedule as ds

from ..pipeline.partition import LayerCost, stage_cost
from ..schedule import (AccumulateAndStep, CommitP2P, DelayedBackward, ForwardPass, LoadMicroBatch, PostP2P,
                        ReverseReconstruct, Timeline, channels)
from ..verify.replay import streams_for
from .costs import Costs, StageCosts
from .simulator import Compute, Endpoint, Mark, Op, Post, Simulation, Wait, simulate
from .torch_programs import SCHEDULES, TORCH_VARIANTS, torch_programs

__all__ = ["GPipeSchedule", "micro_batch_seconds", "simulate_schedule"]


def micro_batch_seconds(schedule: str, c: StageCosts, stage: int, petra_stages: int) -> float:
    """Device seconds of stage ``stage``'s work per micro-batch under ``schedule``: a PETRA stage-clock, a
    pipeline's forward and backward (with the recomputation of ``*_ckpt``); the partition's rule
    (``pipeline/partition.py: stage_cost``) on the stage as one layer, whose reconstruction costs a forward
    with a graph (the table above). The unit :meth:`Costs.host_bound` spreads a host's time over."""
    if schedule.endswith("_rev") or schedule in ("single", "naive_mp"):
        raise ValueError(f"no per-micro-batch unit for {schedule!r}: its stages' work depends on more than the costs")
    rule = "petra" if schedule == "petra" else "backprop_ckpt" if schedule.endswith("_ckpt") else "backprop"
    layer = LayerCost(c.forward, c.forward_grad, c.backward, reconstruct=c.forward_grad)
    return stage_cost([layer], stage, petra_stages, rule=rule)


class GPipeSchedule(ds.PipeSchedule):
    """GPipe (Huang et al. 2019): every micro-batch's forward, then every backward, then the step.

    Step ``t`` of the forward phase runs micro-batch ``t - stage``; the backward phase runs them in the
    same order from the last stage down. Receives come before the compute that needs them and sends
    right after the compute that produced them, so blocking p2p never waits in a cycle.
    """

    def steps(self) -> Iterator[list[ds.PipeInstruction]]:
        k, J, s = self.micro_batches, self.stages, self.stage_id
        for t in range(k + J - 1):
            m = t - s
            if not self._valid_micro_batch(m):
                continue
            cmds: list[ds.PipeInstruction] = []
            if self._valid_stage(self.prev_stage):
                cmds.append(ds.RecvActivation(m))
            if self.is_first_stage or self.is_last_stage:
                cmds.append(ds.LoadMicroBatch(m))
            cmds.append(ds.ForwardPass(m))
            if self._valid_stage(self.next_stage):
                cmds.append(ds.SendActivation(m))
            yield cmds
        for t in range(k + J - 1):
            m = t - (J - 1 - s)
            if not self._valid_micro_batch(m):
                continue
            cmds = []
            if self._valid_stage(self.next_stage):
                cmds.append(ds.RecvGrad(m))
            cmds.append(ds.BackwardPass(m))
            if self._valid_stage(self.prev_stage):
                cmds.append(ds.SendGrad(m))
            yield cmds
        yield [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]

    def num_pipe_buffers(self) -> int:
        return self.micro_batches


def _loss_broadcast(batch: int, rank: int, ranks: int) -> list[Op]:
    """The loss reduction that ends ``train_batch``: the last rank sends, the others wait for it."""
    last = ranks - 1
    if ranks == 1:
        return []
    if rank == last:
        return [Post(Endpoint((("loss", last, r), batch), True, last, eager=True)) for r in range(last)]
    ep = Endpoint((("loss", last, rank), batch), False, rank)
    return [Post(ep), Wait((ep,))]


def _batch_end(batch: int, rank: int, ranks: int) -> list[Op]:
    """What ends a ``train_batch`` on a rank: the loss broadcast, then the batch's mark."""
    return [*_loss_broadcast(batch, rank, ranks), Mark(batch)]


def _endpoint(counts: tuple[dict, dict], channel: channels.Channel, send: bool, stage: int, seconds: float) -> Endpoint:
    """``stage``'s end of the next message on ``channel``: the n-th send and the n-th receive of a channel
    pair up, whichever rank posts first. ``counts``: (sent, received) per channel."""
    counter = counts[0] if send else counts[1]
    endpoint = Endpoint((channel, counter[channel]), send, stage, seconds)
    counter[channel] += 1
    return endpoint


def _petra_programs(costs: Costs, micro_batches: int, batches: int, *, stages_per_rank: int = 1,
                    reversible: Sequence[bool] | None = None, drain: bool = False,
                    input_buffer: str = "non_reversible") -> dict[int, list[Op]]:
    """The engine's own streams, one op per instruction: a send or receive between ranks is posted where
    its batch is posted (``PostP2P``, ``CommitP2P``) and waited for at the clock's ``CommitP2P``; messages
    between two stages of one rank are free (the engine hands them over in memory). A gradient that
    carries x~ is two messages."""
    J, S = costs.stage_count, stages_per_rank
    if J % S:
        raise ValueError(f"{J} stages do not split into ranks of {S}")
    ranks = J // S
    reversible = (True,) * J if reversible is None else tuple(reversible)
    timeline = Timeline(J)
    windows = []
    for _ in range(batches):
        windows.append(timeline.train_window(micro_batches))
        timeline.advance(windows[-1])
    if drain:
        windows.append(timeline.drain_window())
        timeline.advance(windows[-1])
    streams = streams_for(windows, pipeline_ranks=ranks, stages_per_rank=S,
                          gradient_accumulation_steps=micro_batches, reversible=reversible, input_buffer=input_buffer)
    last = J - 1
    programs: dict[int, list[Op]] = {}
    for rank, clocks in streams.items():
        program: list[Op] = []
        counts: tuple[dict, dict] = (defaultdict(int), defaultdict(int))  # messages sent, received per channel
        posted: list[Endpoint] = []
        queued: list[Endpoint] = []
        clock_iter = iter(clocks)
        for w, window in enumerate(windows):
            for _ in range(window.clocks):
                for cmd in next(clock_iter):
                    j = cmd.stage
                    c = costs.stages[j] if j is not None else None
                    if isinstance(cmd, LoadMicroBatch):
                        continue
                    if isinstance(cmd, ForwardPass):
                        op, sec = ("forward_grad", c.forward_grad) if j == last else ("forward", c.forward)
                        program.append(Compute(j, op, cmd.micro_batch, sec))
                    elif isinstance(cmd, ReverseReconstruct):
                        program.append(Compute(j, "reconstruct", cmd.micro_batch, c.forward_grad))
                    elif isinstance(cmd, DelayedBackward):
                        if cmd.consumes is not None:  # its input is exact (FIFO, raw data): recomputed
                            program.append(Compute(j, "recompute", cmd.micro_batch, c.forward_grad))
                        program.append(Compute(j, "backward", cmd.micro_batch, c.backward))
                    elif isinstance(cmd, AccumulateAndStep):
                        program.append(Compute(j, "step", None, c.step))
                    elif cmd.sends is not None:
                        channel = cmd.channel()
                        if cmd.sends and channel.dst // S == rank:
                            continue  # handed over in memory at the commit (the schedule lists no receive for it)
                        size = 2.0 if cmd.with_input else 1.0
                        queued.append(_endpoint(counts, channel, cmd.sends, j, size * costs.message_s))
                    elif isinstance(cmd, (PostP2P, CommitP2P)):
                        program.extend(Post(e) for e in queued)
                        posted += queued
                        queued = []
                        if isinstance(cmd, CommitP2P):
                            if posted:
                                program.append(Wait(tuple(posted)))
                            posted = []
                    else:
                        raise TypeError(f"no cost model for {cmd!r}")
            program += _batch_end(w, rank, ranks)
        programs[rank] = program
    return programs


def _ds_programs(schedule_cls: type, costs: Costs, micro_batches: int, batches: int,
                 recompute: Sequence[bool], forward_keeps_graph: bool = False) -> dict[int, list[Op]]:
    """DeepSpeed schedules: one rank per stage; ``ForwardPass``/``BackwardPass`` carry buffer ids, so
    micro-batches are numbered by the order of the passes (both schedules run them in order)."""
    J = costs.stage_count
    programs: dict[int, list[Op]] = {}
    for s in range(J):
        c = costs.stages[s]
        program: list[Op] = []
        counts: tuple[dict, dict] = (defaultdict(int), defaultdict(int))  # messages sent, received per channel
        for b in range(batches):
            forwards = backwards = 0
            for step_cmds in schedule_cls(micro_batches=micro_batches, stages=J, stage_id=s):
                for cmd in step_cmds:
                    if isinstance(cmd, ds.ForwardPass):
                        m = b * micro_batches + forwards
                        forwards += 1
                        if recompute[s] and not forward_keeps_graph:
                            program.append(Compute(s, "forward", m, c.forward))
                        else:
                            program.append(Compute(s, "forward_grad", m, c.forward_grad))
                    elif isinstance(cmd, ds.BackwardPass):
                        m = b * micro_batches + backwards
                        backwards += 1
                        split = c.deepspeed_factor if s < J - 1 else 1.0  # the last stage: loss.backward()
                        if recompute[s]:
                            program.append(Compute(s, "recompute", m, split * c.forward_grad))
                        program.append(Compute(s, "backward", m, split * c.backward))
                    elif isinstance(cmd, ds.OptimizerStep):
                        program.append(Compute(s, "step", None, c.step))
                    elif isinstance(cmd, (ds.SendActivation, ds.SendGrad, ds.RecvActivation, ds.RecvGrad)):
                        send = isinstance(cmd, (ds.SendActivation, ds.SendGrad))
                        ep = _endpoint(counts, _DS_CHANNELS[type(cmd)](s), send, s, costs.message_s)
                        program += [Post(ep), Wait((ep,))]  # blocking p2p
                    elif isinstance(cmd, (ds.LoadMicroBatch, ds.ReduceGrads, ds.ReduceTiedGrads)):
                        continue
                    else:
                        raise TypeError(f"no cost model for {cmd!r}")
            program += _batch_end(b, s, J)
        programs[s] = program
    return programs


#: the channel each of DeepSpeed's p2p instructions uses at stage s (``channels``' helpers name PETRA's the same way)
_DS_CHANNELS = {
    ds.SendActivation: channels.forward_channel,
    ds.RecvActivation: lambda s: channels.forward_channel(s - 1),
    ds.SendGrad: channels.backward_channel,
    ds.RecvGrad: lambda s: channels.backward_channel(s + 1),
}

_PIPELINES = {"1f1b": ds.TrainSchedule, "gpipe": GPipeSchedule, "naive_mp": ds.TrainSchedule}


def simulate_schedule(schedule: str, costs: Costs, micro_batches: int, batches: int, *,
                      stages_per_rank: int = 1, reversible: Sequence[bool] | None = None,
                      drain: bool = False) -> Simulation:
    """``batches`` consecutive ``train_batch`` calls of ``micro_batches`` micro-batches from a cold start.

    ``schedule``: ``petra``, ``1f1b``, ``gpipe`` or ``naive_mp`` (one micro-batch per ``train_batch``:
    ``micro_batches`` is then ignored), the last three optionally with ``_ckpt`` (every stage recomputes)
    or ``_rev`` (the reversible stages recompute), or one of torch's (``TORCH_VARIANTS``). ``drain``
    (PETRA only) appends the clocks that finish every fed micro-batch. ``reversible`` defaults to all
    stages.
    """
    meta: dict[str, int] = {}
    if schedule == "petra":
        programs = _petra_programs(costs, micro_batches, batches, stages_per_rank=stages_per_rank,
                                   reversible=reversible, drain=drain)
    elif schedule in TORCH_VARIANTS:
        programs = torch_programs(schedule, costs, micro_batches, batches)
        meta["stages_per_rank"] = SCHEDULES[schedule.removesuffix("_ckpt")][1]
    else:
        J = costs.stage_count
        base, _, mode = schedule.rpartition("_") if schedule.endswith(("_ckpt", "_rev")) else (schedule, "", "")
        if base not in _PIPELINES:
            raise ValueError(f"unknown schedule {schedule!r}")
        if base == "naive_mp":
            micro_batches = 1
        recompute = {"": [False] * J, "ckpt": [True] * J,
                     "rev": [True] * J if reversible is None else list(reversible)}[mode]
        programs = _ds_programs(_PIPELINES[base], costs, micro_batches, batches, recompute,
                                forward_keeps_graph=mode == "ckpt")
    events, rank_ends = simulate(programs)
    return Simulation(events, rank_ends, costs.stage_count, micro_batches, schedule, meta)

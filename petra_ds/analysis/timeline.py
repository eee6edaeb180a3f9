"""Replay pipeline instruction streams with measured costs: time per micro-batch and Gantt charts.

The schedules are data. PETRA's are the engine's own streams (``petra_ds.replay.streams_for``), 1F1B is
DeepSpeed's ``TrainSchedule``, naive model parallelism the same with one micro-batch per
``train_batch``, GPipe a small ``PipeSchedule`` below that yields DeepSpeed's instructions. Every
instruction gets a duration from a few measured primitives of each stage (:class:`StageCosts`), and an
event simulator plays all ranks against each other with the engines' communication semantics:

- PETRA: sends and receives are posted (non-blocking) by the ``PostP2P`` after them (the activations'
  batch after the forwards, the gradients' after the backwards) or the clock's ``CommitP2P``, which waits
  for all of them; a transfer takes ``message_s`` once both sides are posted (a gradient that carries
  the reconstructed input x~ is two messages);
- DeepSpeed: every ``Send*``/``Recv*`` is a blocking p2p call, matched in order on its channel;
- both: ``train_batch`` ends with the loss broadcast from the last stage, which the others wait for.

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
==========================  =====================================================================

``naive_mp_rev`` is the paper's "Rev. backprop." baseline of Tab. 5: model parallelism without overlap,
where the reversible stages rebuild their inputs in the backward instead of storing activations.

    python -m petra_ds.analysis.timeline                     # Tab. 5 picture: RevNet18 (J=10), RevNet34 (J=18)
    python -m petra_ds.analysis.timeline --uniform --stages 4 --micro-batches 4
    python -m petra_ds.analysis.timeline --validate benchmarks/results/throughput_revgpt_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import torch
from deepspeed.runtime.pipe import schedule as ds
from torch import nn

from ..replay import streams_for
from ..schedule import (
    AccumulateAndStep,
    CommitP2P,
    DelayedBackward,
    ForwardPass,
    LoadMicroBatch,
    PostP2P,
    RecvActivation,
    RecvGrad,
    ReverseReconstruct,
    SendActivation,
    SendGrad,
    Timeline,
)

__all__ = [
    "Costs",
    "GPipeSchedule",
    "PAPER_TAB5",
    "Simulation",
    "StageCosts",
    "VARIANTS",
    "measure_message_seconds",
    "measure_stage_costs",
    "plot_gantt",
    "predict",
    "revnet_costs",
    "seconds_per_micro_batch",
    "simulate",
    "simulate_schedule",
    "validate",
]

#: what the simulator predicts; ``single`` is one process running every stage
VARIANTS = ("single", "naive_mp", "naive_mp_ckpt", "naive_mp_rev", "gpipe", "gpipe_ckpt", "1f1b", "1f1b_ckpt",
            "1f1b_rev", "petra")
#: paper Tab. 5: model -> (J, Rev. backprop. ms, PETRA ms) per micro-batch of 256 CIFAR-10 images
PAPER_TAB5 = {18: (10, 160.3, 53.4), 34: (18, 235.6, 97.1)}
RESULTS = os.path.join("benchmarks", "results")


# --- costs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCosts:
    """Measured seconds of one stage's primitives, for one micro-batch.

    ``backward_split``: the backward as DeepSpeed's ``PipelineEngine`` runs it at a stage whose output is
    several tensors (a reversible stage's pair): one ``backward(retain_graph=True)`` call per tensor,
    which walks the shared part of the graph again. ``None``: the same as ``backward``.
    """

    forward: float
    forward_grad: float
    backward: float
    step: float = 0.0
    backward_split: float | None = None

    @property
    def deepspeed_factor(self) -> float:
        """How much longer DeepSpeed's backward takes than one backward call (1 without a measurement)."""
        return 1.0 if self.backward_split is None else self.backward_split / self.backward


@dataclass(frozen=True)
class Costs:
    """Per-stage costs and the time of one activation-sized message between neighbouring ranks."""

    stages: tuple[StageCosts, ...]
    message_s: float = 0.0

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @classmethod
    def uniform(cls, num_stages: int, forward: float, forward_grad: float, backward: float,
                step: float = 0.0, message_s: float = 0.0) -> "Costs":
        return cls((StageCosts(forward, forward_grad, backward, step),) * num_stages, message_s)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Costs":
        """The ``"costs"`` entry of a benchmark report: ``{"stages": [{forward, forward_grad, backward,
        step[, backward_split]}, ...], "message_s": s}``."""
        stages = tuple(StageCosts(float(s["forward"]), float(s["forward_grad"]), float(s["backward"]),
                                  float(s.get("step", 0.0)),
                                  None if s.get("backward_split") is None else float(s["backward_split"]))
                       for s in data["stages"])
        return cls(stages, float(data.get("message_s", 0.0)))

    def to_dict(self) -> dict[str, Any]:
        stages = [{k: v for k, v in asdict(s).items() if v is not None} for s in self.stages]
        return {"stages": stages, "message_s": self.message_s}


# --- GPipe ----------------------------------------------------------------------------------------


class GPipeSchedule(ds.PipeSchedule):
    """GPipe (Huang et al. 2019): every micro-batch's forward, then every backward, then the step.

    Step ``t`` of the forward phase runs micro-batch ``t - stage``; the backward phase runs them in the
    same order from the last stage down. Receives come before the compute that needs them and sends
    right after the compute that produced them, so blocking p2p never waits in a cycle.
    """

    def steps(self):
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


# --- the programs the simulator runs ---------------------------------------------------------------


@dataclass(frozen=True)
class Compute:
    stage: int
    op: str
    micro_batch: int | None
    seconds: float


@dataclass(frozen=True)
class Endpoint:
    """One side of a message, posted without blocking. ``key`` = (channel, n): the n-th message on a
    channel, so sends and receives pair up in order. The transfer takes ``seconds`` once both sides are
    posted; an ``eager`` send is complete when posted (a scalar broadcast)."""

    key: tuple
    send: bool
    stage: int
    seconds: float = 0.0
    eager: bool = False


@dataclass(frozen=True)
class Post:
    endpoint: Endpoint


@dataclass(frozen=True)
class Wait:
    """Block until every listed endpoint's message is complete (a commit, or a blocking send/recv)."""

    endpoints: tuple[Endpoint, ...]


@dataclass(frozen=True)
class Mark:
    """The end of a ``train_batch`` call (window) on this rank."""

    index: int


Op = Union[Compute, Post, Wait, Mark]


@dataclass(frozen=True)
class Event:
    rank: int
    stage: int
    op: str
    micro_batch: int | None
    start: float
    end: float


@dataclass
class Simulation:
    """What ran where and when; ``rank_ends[r][w]``: when rank r returned from batch ``w``."""

    events: list[Event]
    rank_ends: dict[int, list[float]]
    num_stages: int
    micro_batches: int
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_ends(self) -> list[float]:
        """When the last rank returned from each batch."""
        return [max(ends) for ends in zip(*self.rank_ends.values())]

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0)


class DeadlockError(RuntimeError):
    """Every unfinished rank waits for a message that no rank will post."""


def simulate(programs: Mapping[int, Sequence[Op]]) -> tuple[list[Event], dict[int, list[float]]]:
    """Run every rank's program from time 0; a rank computes one op at a time while its posted messages
    travel. A message's transfer starts once both sides are posted.

    Returns the events (compute, and transfers on the receiver's row) and, per rank, when it reached
    each batch mark. The result does not depend on the order ranks are visited: a rank's times
    only depend on its own ops and on when its partners posted their side of each message.
    """
    now = {r: 0.0 for r in programs}
    pos = {r: 0 for r in programs}
    posted: dict[tuple, float] = {}  # (key, send) -> when that side was posted
    events: list[Event] = []
    marks: dict[int, list[float]] = {r: [] for r in programs}
    while True:
        progressed = False
        for r, program in programs.items():
            while pos[r] < len(program):
                op = program[pos[r]]
                if isinstance(op, Compute):
                    if op.seconds > 0:
                        events.append(Event(r, op.stage, op.op, op.micro_batch, now[r], now[r] + op.seconds))
                    now[r] += op.seconds
                elif isinstance(op, Post):
                    ep = op.endpoint
                    posted[(ep.key, ep.send)] = now[r]
                    other = posted.get((ep.key, not ep.send))
                    if other is not None and ep.seconds > 0:
                        start = max(other, now[r])
                        stage = ep.stage if not ep.send else ep.key[0][2]
                        events.append(Event(r, stage, "message", None, start, start + ep.seconds))
                elif isinstance(op, Wait):
                    done = now[r]
                    for ep in op.endpoints:
                        own = posted[(ep.key, ep.send)]
                        if ep.eager:
                            done = max(done, own)
                            continue
                        other = posted.get((ep.key, not ep.send))
                        if other is None:
                            break
                        done = max(done, max(own, other) + ep.seconds)
                    else:
                        now[r] = done
                        pos[r] += 1
                        progressed = True
                        continue
                    break
                else:
                    marks[r].append(now[r])
                pos[r] += 1
                progressed = True
        if all(pos[r] >= len(p) for r, p in programs.items()):
            break
        if not progressed:
            stuck = {r: programs[r][pos[r]] for r in programs if pos[r] < len(programs[r])}
            raise DeadlockError(f"deadlock: {stuck}")
    return events, marks


def _loss_broadcast(batch: int, rank: int, ranks: int) -> list[Op]:
    """The loss reduction that ends ``train_batch``: the last rank sends, the others wait for it."""
    last = ranks - 1
    if ranks == 1:
        return []
    if rank == last:
        return [Post(Endpoint((("loss", last, r), batch), True, last, eager=True)) for r in range(last)]
    ep = Endpoint((("loss", last, rank), batch), False, rank)
    return [Post(ep), Wait((ep,))]


# --- lowering the instruction streams ------------------------------------------------------------


def _endpoint(counts: tuple[dict, dict], stage: int, other: int, send: bool, grad: bool, seconds: float) -> Endpoint:
    """One end of the next message on its channel (act or grad, source -> destination): the n-th send
    and the n-th receive of a channel pair up, whichever rank posts first. ``counts``: (sent, received)."""
    src, dst = (stage, other) if send else (other, stage)
    channel = ("grad" if grad else "act", src, dst)
    counter = counts[0] if send else counts[1]
    endpoint = Endpoint((channel, counter[channel]), send, stage, seconds)
    counter[channel] += 1
    return endpoint



def _petra_programs(costs: Costs, micro_batches: int, batches: int, *, stages_per_rank: int = 1,
                    reversible: Sequence[bool] | None = None, drain: bool = False) -> dict[int, list[Op]]:
    """The engine's own streams, one op per instruction: a send or receive between ranks is posted where
    its batch is posted (``PostP2P``, ``CommitP2P``) and waited for at the clock's ``CommitP2P``; messages between two stages of
    one rank are free (the engine hands them over in memory). A gradient that carries x~ is two messages."""
    J, S = costs.num_stages, stages_per_rank
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
                          gradient_accumulation_steps=micro_batches, reversible=reversible)
    last = J - 1

    def reconstructs(j: int) -> bool:
        return 0 < j < last and reversible[j]

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
                    j = getattr(cmd, "stage", None)
                    c = costs.stages[j] if j is not None else None
                    if isinstance(cmd, LoadMicroBatch):
                        continue
                    if isinstance(cmd, ForwardPass):
                        op, sec = ("forward_grad", c.forward_grad) if j == last else ("forward", c.forward)
                        program.append(Compute(j, op, cmd.micro_batch, sec))
                    elif isinstance(cmd, ReverseReconstruct):
                        program.append(Compute(j, "reconstruct", cmd.micro_batch, c.forward_grad))
                    elif isinstance(cmd, DelayedBackward):
                        if j != last and not reconstructs(j):
                            program.append(Compute(j, "recompute", cmd.micro_batch, c.forward_grad))
                        program.append(Compute(j, "backward", cmd.micro_batch, c.backward))
                    elif isinstance(cmd, AccumulateAndStep):
                        program.append(Compute(j, "step", None, c.step))
                    elif isinstance(cmd, (SendActivation, SendGrad, RecvActivation, RecvGrad)):
                        grad = isinstance(cmd, (SendGrad, RecvGrad))
                        send = isinstance(cmd, (SendActivation, SendGrad))
                        other = j + (1 if isinstance(cmd, (SendActivation, RecvGrad)) else -1)
                        if other // S == rank:
                            continue  # handed over in memory
                        size = 2.0 if grad and cmd.with_input else 1.0
                        queued.append(_endpoint(counts, j, other, send, grad, size * costs.message_s))
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
            program += _loss_broadcast(w, rank, ranks)
            program.append(Mark(w))
        programs[rank] = program
    return programs


def _ds_programs(schedule_cls: type, costs: Costs, micro_batches: int, batches: int,
                 recompute: Sequence[bool], forward_keeps_graph: bool = False) -> dict[int, list[Op]]:
    """DeepSpeed schedules: one rank per stage; ``ForwardPass``/``BackwardPass`` carry buffer ids, so
    micro-batches are numbered by the order of the passes (both schedules run them in order)."""
    J = costs.num_stages
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
                        grad = isinstance(cmd, (ds.SendGrad, ds.RecvGrad))
                        other = s + (1 if isinstance(cmd, (ds.SendActivation, ds.RecvGrad)) else -1)
                        ep = _endpoint(counts, s, other, send, grad, costs.message_s)
                        program += [Post(ep), Wait((ep,))]  # blocking p2p
                    elif isinstance(cmd, (ds.LoadMicroBatch, ds.ReduceGrads, ds.ReduceTiedGrads)):
                        continue
                    else:
                        raise TypeError(f"no cost model for {cmd!r}")
            program += _loss_broadcast(b, s, J)
            program.append(Mark(b))
        programs[s] = program
    return programs


_PIPELINES = {"1f1b": ds.TrainSchedule, "gpipe": GPipeSchedule, "naive_mp": ds.TrainSchedule}


def simulate_schedule(schedule: str, costs: Costs, micro_batches: int, batches: int, *,
                      stages_per_rank: int = 1, reversible: Sequence[bool] | None = None,
                      drain: bool = False) -> Simulation:
    """``batches`` consecutive ``train_batch`` calls of ``micro_batches`` micro-batches from a cold start.

    ``schedule``: ``petra``, ``1f1b``, ``gpipe`` or ``naive_mp`` (one micro-batch per ``train_batch``:
    ``micro_batches`` is then ignored), the last three optionally with ``_ckpt`` (every stage recomputes)
    or ``_rev`` (the reversible stages recompute). ``drain`` (PETRA only) appends the clocks that finish
    every fed micro-batch. ``reversible`` defaults to all stages.
    """
    if schedule == "petra":
        programs = _petra_programs(costs, micro_batches, batches, stages_per_rank=stages_per_rank,
                                   reversible=reversible, drain=drain)
    else:
        J = costs.num_stages
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
    return Simulation(events, rank_ends, costs.num_stages, micro_batches, schedule)


# --- predictions --------------------------------------------------------------------------------


def seconds_per_micro_batch(variant: str, costs: Costs, micro_batches: int, *, stages_per_rank: int = 1,
                            reversible: Sequence[bool] | None = None) -> float:
    """Steady-state seconds per micro-batch of ``variant`` (see ``VARIANTS``) with k = ``micro_batches``.

    Pipelines flush every ``train_batch``: the time between the ends of consecutive batches / k. PETRA
    never flushes: its pace once the first micro-batch has gone all the way back, taken from the slowest
    rank over whole windows. (After the fill the later stages run ahead of the earlier ones by up to a
    clock per stage, which they only use up slowly when stages are nearly balanced; the slowest rank is
    already at the steady pace while the others still run faster.)
    """
    k = micro_batches
    if variant == "single":
        return sum(s.forward_grad + s.backward + s.step / k for s in costs.stages)
    J = costs.num_stages
    if variant == "petra":
        warm = math.ceil((2 * J - 1) / k) + 1
        measured = max(4, math.ceil(4 * J / k))
        sim = simulate_schedule("petra", costs, k, warm + measured, stages_per_rank=stages_per_rank,
                                reversible=reversible)
        return max(ends[-1] - ends[warm - 1] for ends in sim.rank_ends.values()) / (measured * k)
    per_batch = 1 if variant.startswith("naive_mp") else k
    sim = simulate_schedule(variant, costs, per_batch, 3, reversible=reversible)
    return (sim.batch_ends[2] - sim.batch_ends[0]) / (2 * per_batch)


def predict(costs: Costs, micro_batches: int, variants: Sequence[str] = VARIANTS, *,
            reversible: Sequence[bool] | None = None) -> dict[str, float]:
    """Seconds per micro-batch of each variant."""
    return {v: seconds_per_micro_batch(v, costs, micro_batches, reversible=reversible) for v in variants}


def validate(report: Mapping[str, Any], tolerance: float = 0.15, costs: Costs | None = None) -> dict[str, Any]:
    """Predicted vs measured samples/s of every variant of a throughput report.

    The report holds ``"costs"`` (see :meth:`Costs.from_dict`; or pass ``costs``, e.g. those of another
    run of the same model and partition), ``"variants": {name: {"samples_per_s"}}``, ``"micro_batch_size"``,
    ``"micro_batches"`` (k) and ``"stages"`` (J). ``"ds_streams": "stacked"`` says DeepSpeed's pipeline
    got each stage's pair of streams as one tensor, so its backward is one call: ``backward_split`` is
    then not used. Variants this module does not model are listed under ``"skipped"``."""
    costs = Costs.from_dict(report["costs"]) if costs is None else costs
    if report.get("ds_streams") == "stacked":
        costs = Costs(tuple(replace(s, backward_split=None) for s in costs.stages), costs.message_s)
    J, k, size = int(report["stages"]), int(report["micro_batches"]), int(report["micro_batch_size"])
    if costs.num_stages != J:
        raise ValueError(f"the report has {J} stages but costs for {costs.num_stages}")
    rows: dict[str, dict[str, float]] = {}
    skipped = []
    for name, measured in report["variants"].items():
        if name not in VARIANTS or not measured.get("samples_per_s"):
            skipped.append(name)
            continue
        seconds = seconds_per_micro_batch(name, costs, k)
        predicted = size / seconds
        got = float(measured["samples_per_s"])
        rows[name] = {"measured_samples_per_s": got, "predicted_samples_per_s": predicted,
                      "predicted_ms_per_micro_batch": 1e3 * seconds, "measured_ms_per_micro_batch": 1e3 * size / got,
                      "relative_error": (predicted - got) / got}
    worst = max((abs(r["relative_error"]) for r in rows.values()), default=0.0)
    return {"stages": J, "micro_batches": k, "micro_batch_size": size, "tolerance": tolerance,
            "ds_streams": report.get("ds_streams"), "costs": costs.to_dict(), "variants": rows, "skipped": skipped,
            "max_abs_relative_error": worst, "within_tolerance": worst <= tolerance}


# --- measuring the primitives -------------------------------------------------------------------


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


def _leaves(x: Any, grad: bool) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(grad and x.is_floating_point())
    if isinstance(x, (tuple, list)):
        return type(x)(_leaves(t, grad) for t in x)
    return x


def _sync(tensors: Sequence[torch.Tensor]) -> None:
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def _modules(stage: Any, depth: int = 0) -> list[nn.Module]:
    """The modules behind a stage callable, whose buffers the measurement must restore: a module, a
    list of layers, ``functools.partial(forward_fn, module)``, or a bound method (``petra_ds`` stage's
    ``run``) of an object holding modules or lists of them."""
    if isinstance(stage, nn.Module):
        return [stage]
    if isinstance(stage, (list, tuple)):
        return [m for layer in stage for m in _modules(layer, depth)]
    found = [a for a in getattr(stage, "args", ()) if isinstance(a, nn.Module)]
    owner = getattr(stage, "__self__", None)
    if owner is not None and depth == 0:
        found += _modules(owner, 1) if isinstance(owner, nn.Module) else [
            m for value in vars(owner).values() if isinstance(value, (nn.Module, list, tuple))
            for m in _modules(value, 1)]
    return found


def measure_stage_costs(stage: Callable | Sequence[Callable], x: Any, params: Iterable[torch.Tensor] | None = None, *,
                        loss_fn: Callable | None = None, labels: Any = None,
                        optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
                        input_grad: bool = True, split_backward: bool = True, repeats: int = 5,
                        warmup: int = 1) -> dict[str, float]:
    """Median seconds of one stage's ``forward``, ``forward_grad``, ``backward`` and ``step``.

    ``stage`` is a callable or a list of layers applied in order; ``x`` one micro-batch of its input. With
    ``loss_fn`` (the last stage) the forward with a graph includes ``loss_fn(out, labels)`` and the
    backward starts from the loss; otherwise it starts from a random output gradient. ``input_grad``:
    whether the backward also produces the gradient of ``x`` (False for stage 0, whose input is data).
    ``step`` times ``optimizer`` (a factory of a parameter list; default AdamW) on copies of ``params``
    (default: the stage's parameters). With ``split_backward`` and an output of several tensors, also
    ``backward_split``: DeepSpeed's pipeline backward, one call per output tensor (see :class:`StageCosts`).
    The caller's state is left as it was: parameter gradients, buffers (batch-norm statistics) and the
    RNG are restored, and the optimizer never touches the model.
    """
    layers = list(stage) if isinstance(stage, (list, tuple)) else [stage]

    def run(inp: Any) -> Any:
        for layer in layers:
            inp = layer(inp)
        return inp

    modules = _modules(layers)
    if params is None:
        params = [p for m in modules for p in m.parameters()]
    params = list({id(p): p for p in params if p.requires_grad}.values())
    saved_grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    buffers = {id(b): b for m in modules for b in m.buffers()}.values()
    saved_buffers = [(b, b.detach().clone()) for b in buffers]
    tensors = _tensors(x)
    devices = [t.device.index or 0 for t in tensors if t.is_cuda]
    timings: dict[str, list[float]] = defaultdict(list)

    def timed(name: str, fn: Callable[..., Any], record: bool, *args: Any) -> Any:
        _sync(tensors)
        t0 = time.perf_counter()
        out = fn(*args)
        _sync(tensors)
        if record:
            timings[name].append(time.perf_counter() - t0)
        return out

    def one_by_one(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        for i, (out, grad) in enumerate(zip(outs, grads)):
            out.backward(grad, retain_graph=i < len(outs) - 1)

    def graph() -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        with torch.enable_grad():
            out = run(_leaves(x, input_grad))
            if loss_fn is not None:
                return [loss_fn(out, labels)], None
        outs = [t for t in _tensors(out) if t.requires_grad]
        return outs, [torch.randn_like(t) for t in outs]

    try:
        with torch.random.fork_rng(devices=sorted(set(devices))):
            for i in range(warmup + repeats):
                record = i >= warmup
                with torch.no_grad():
                    timed("forward", run, record, x)
                outs, grads = timed("forward_grad", graph, record)
                timed("backward", torch.autograd.backward, record, outs, grads)
                if split_backward and loss_fn is None and len(outs) > 1:
                    outs, grads = graph()
                    timed("backward_split", one_by_one, record, outs, grads)
                del outs, grads
        copies = [p.detach().clone().requires_grad_(True) for p in params]
        if not copies:
            timings["step"].append(0.0)
        opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3)))(copies) if copies else None
        for i in range(warmup + repeats if copies else 0):
            for c in copies:
                c.grad = torch.full_like(c, 1e-3)
            timed("step", opt.step, i >= warmup)
    finally:
        with torch.no_grad():
            for p, g in zip(params, saved_grads):
                p.grad = g
            for b, v in saved_buffers:
                b.copy_(v)
    return {name: statistics.median(values) for name, values in timings.items()}


def measure_message_seconds(x: Any, peer: int, *, first: bool, repeats: int = 20, warmup: int = 1,
                            group: Any = None) -> float:
    """Median seconds of one message ``x`` (a tensor or nested tensors) between this rank and ``peer``:
    half a round trip of blocking send/recv, the rank with ``first`` sending first. Both ranks call it."""
    import torch.distributed as tdist

    tensors = [t.detach().contiguous() for t in _tensors(x)]
    times = []
    for i in range(warmup + repeats):
        _sync(tensors)
        t0 = time.perf_counter()
        for phase in (first, not first):
            for t in tensors:
                (tdist.send if phase else tdist.recv)(t, peer, group)
        _sync(tensors)
        if i >= warmup:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def revnet_costs(depth: int, micro_batch: int = 32, *, image: int = 32, num_classes: int = 10,
                 base_width: int = 64, repeats: int = 5, seed: int = 0) -> tuple[Costs, list[bool], list[str]]:
    """Per-stage costs of RevNet-``depth`` cut one layer per stage (stem, residual blocks, head: the
    paper's 10 stages for RevNet18, 18 for RevNet34), measured in this process, train mode, with the
    SGD-with-momentum step of the recipe. Without ``backward_split``: the pipelines are the schedules
    themselves, not DeepSpeed's engine. Returns the costs, which stages are reversible and the layer names."""
    from ..models.revnet import revnet_layers
    from ..nn.reversible import is_reversible

    torch.manual_seed(seed)
    layers = [spec.build() for spec in revnet_layers(depth, num_classes, cifar=image <= 64, base_width=base_width)]
    x: Any = torch.randn(micro_batch, 3, image, image)
    labels = torch.randint(0, num_classes, (micro_batch,))
    stages = []
    for j, layer in enumerate(layers):
        layer.train()
        last = j == len(layers) - 1
        c = measure_stage_costs(layer, x, loss_fn=nn.functional.cross_entropy if last else None,
                                labels=labels if last else None, input_grad=j > 0, repeats=repeats,
                                split_backward=False,
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True))
        stages.append(StageCosts(**c))
        with torch.no_grad():
            x = layer(x)
    return Costs(tuple(stages)), [is_reversible(m) for m in layers], [type(m).__name__ for m in layers]


# --- Gantt charts -------------------------------------------------------------------------------

COLORS = {"forward": "#4c78a8", "forward_grad": "#1f3f73", "reconstruct": "#f58518", "recompute": "#f2b25c",
          "backward": "#54a24b", "step": "#7f7f7f", "message": "#e45756"}
LABELS = {"forward": "forward", "forward_grad": "forward with graph", "reconstruct": "reconstruct (inverse)",
          "recompute": "recompute", "backward": "backward", "step": "optimizer step", "message": "transfer"}


def plot_gantt(simulations: Sequence[Simulation], path: str, title: str = "", time_unit: str = "ms") -> str:
    """One panel per simulation, one row per stage (stage 0 on top), a colour per op, micro-batch numbers
    on the bars wide enough to hold them; all panels share the time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[time_unit]
    span = max(s.meta.get("span", s.makespan) for s in simulations) * scale or 1.0
    width_in = 13.0
    rows = sum(s.num_stages for s in simulations)
    fig, axes = plt.subplots(len(simulations), 1, sharex=True, squeeze=False,
                             figsize=(width_in, 1.2 + 0.28 * rows + 0.5 * len(simulations)))
    char = span * 0.0065 * 13.0 / width_in  # the width of one digit of the labels, in time units
    used = set()
    for ax, sim in zip(axes[:, 0], simulations):
        for e in sim.events:
            start, dur = e.start * scale, (min(e.end * scale, span) - e.start * scale)
            message = e.op == "message"  # a thin bar under the row: transfers may overlap compute
            row, height = (e.stage + 0.36, 0.1) if message else (e.stage, 0.7)
            ax.barh(row, dur, left=start, height=height, color=COLORS.get(e.op, "black"),
                    edgecolor="none" if message else "white", linewidth=0.3)
            used.add(e.op)
            if e.micro_batch is not None and dur >= char * (len(str(e.micro_batch)) + 1):
                ax.text(start + dur / 2, row, str(e.micro_batch), ha="center", va="center", fontsize=6,
                        color="white")
        ax.set_ylim(sim.num_stages - 0.5, -0.5)
        ticks = range(sim.num_stages) if sim.num_stages <= 10 else range(0, sim.num_stages, 2)
        ax.set_yticks(list(ticks))
        ax.set_ylabel("stage")
        ax.set_title(sim.name, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel(f"time ({time_unit})")
    axes[-1, 0].set_xlim(0, span)
    handles = [Patch(color=COLORS[op], label=LABELS[op]) for op in COLORS if op in used]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gantt_panels(costs: Costs, micro_batches: int, *, reversible: Sequence[bool] | None = None,
                 schedules: Sequence[str] = ("petra", "1f1b", "gpipe", "naive_mp"),
                 steady_windows: int = 3) -> list[Simulation]:
    """The same stretch of wall time for every schedule from a cold start: as long as PETRA takes to fill
    its pipeline and run ``steady_windows`` more windows; each panel is titled with its steady-state time
    per micro-batch and ``meta["span"]`` holds the stretch."""
    J, k = costs.num_stages, micro_batches
    petra_windows = math.ceil((2 * J - 1) / k) + steady_windows
    span = simulate_schedule("petra", costs, k, petra_windows, reversible=reversible).batch_ends[-1]
    sims = []
    for name in schedules:
        steady = seconds_per_micro_batch(name, costs, k, reversible=reversible)
        if name == "petra":
            batches = petra_windows
        else:
            per_batch = 1 if name.startswith("naive_mp") else k
            batches = math.ceil(span / (steady * per_batch)) + 1
        sim = simulate_schedule(name, costs, k, batches, reversible=reversible)
        sim.events = [e for e in sim.events if e.start < span]
        done = len({e.micro_batch for e in sim.events if e.stage == 0 and e.op == "backward" and e.end <= span})
        sim.name = (f"{_NAMES.get(name, name)}: {1e3 * steady:.3g} ms per micro-batch in steady state; "
                    f"{done} micro-batches done in this stretch")
        sim.meta["span"] = span
        sims.append(sim)
    return sims


_NAMES = {"petra": "PETRA", "1f1b": "1F1B (DeepSpeed TrainSchedule)", "gpipe": "GPipe",
          "naive_mp": "naive model parallelism", "naive_mp_ckpt": "naive MP + activation checkpointing",
          "naive_mp_rev": "naive MP, reversible backprop (paper's baseline)", "1f1b_rev": "1F1B, reversible backprop",
          "1f1b_ckpt": "1F1B + activation checkpointing", "gpipe_ckpt": "GPipe + activation checkpointing",
          "single": "single process"}


# --- command line -------------------------------------------------------------------------------


def _table(predictions: Mapping[int, Mapping[str, float]], mbs: int) -> str:
    ks = sorted(predictions)
    head = f"{'variant':16s}" + "".join(f" {'k=' + str(k) + ' ms/mb':>12s} {'samples/s':>10s}" for k in ks)
    lines = [head]
    for v in predictions[ks[0]]:
        lines.append(f"{v:16s}" + "".join(f" {1e3 * predictions[k][v]:12.2f} {mbs / predictions[k][v]:10.1f}"
                                          for k in ks))
    return "\n".join(lines)


def _revnet_report(args: argparse.Namespace) -> dict[str, Any]:
    saved: dict[str, Any] = {"models": {}}
    if args.costs_from:
        with open(args.costs_from) as f:
            saved = json.load(f)
    report: dict[str, Any] = {"command": args.command, "measured_by": saved.get("measured_by", args.command),
                              "micro_batch_size": args.micro_batch,
                              "threads": saved.get("threads", torch.get_num_threads()),  # of the measurement
                              "message_s": args.message_s, "models": {}}
    saved = saved["models"]
    for depth in args.depths:
        name = f"revnet{depth}"
        if name in saved:
            costs = Costs.from_dict(saved[name]["costs"])
            reversible, layer_names = saved[name]["reversible"], saved[name]["layers"]
            mbs = saved[name].get("micro_batch_size", args.micro_batch)
        else:
            t0 = time.perf_counter()
            costs, reversible, layer_names = revnet_costs(depth, args.micro_batch, repeats=args.repeats)
            mbs = args.micro_batch
            print(f"measured RevNet{depth} ({len(layer_names)} stages) in {time.perf_counter() - t0:.0f} s")
        costs = Costs(costs.stages, args.message_s)
        J = costs.num_stages
        preds = {k: predict(costs, k, reversible=reversible) for k in args.k}
        per_stage = [s.forward + s.forward_grad + s.backward for s in costs.stages]
        print(f"\nRevNet{depth}, J = {J}, micro-batch {mbs}, message {1e3 * args.message_s:g} ms, "
              f"costs measured with {report['threads']} thread(s)")
        print("stage costs (ms): " + ", ".join(f"{j}:{name_}{'' if rev else '*'} "
                                             f"f={1e3 * s.forward:.1f}/fg={1e3 * s.forward_grad:.1f}/"
                                             f"b={1e3 * s.backward:.1f}"
                                             for j, (name_, rev, s) in enumerate(zip(layer_names, reversible,
                                                                                     costs.stages))))
        print(_table(preds, mbs))
        ratios = {k: {f"{v}/petra": p[v] / p["petra"] for v in p if v != "petra"} for k, p in preds.items()}
        paper = PAPER_TAB5.get(depth)
        for k in args.k:
            r = ratios[k]
            print(f"k={k}: PETRA's speed-up over Rev. backprop (naive_mp_rev) {r['naive_mp_rev/petra']:.2f}x"
                  + (f" (paper {paper[1] / paper[2]:.1f}x)" if paper else "")
                  + f", over naive MP {r['naive_mp/petra']:.2f}x, 1F1B {r['1f1b/petra']:.2f}x, "
                  f"1F1B reversible {r['1f1b_rev/petra']:.2f}x, GPipe {r['gpipe/petra']:.2f}x, "
                  f"single process {r['single/petra']:.2f}x")
        slowest = max(range(J), key=lambda j: per_stage[j])
        print(f"slowest stage {slowest} ({layer_names[slowest]}): {1e3 * per_stage[slowest]:.1f} ms per clock; "
              f"sum over stages {1e3 * sum(per_stage):.1f} ms; balance sum/(J max) = "
              f"{sum(per_stage) / (J * per_stage[slowest]):.2f}")
        report["models"][name] = {
            "stages": J, "micro_batch_size": mbs, "layers": layer_names, "reversible": list(reversible),
            "costs": costs.to_dict(), "ms_per_micro_batch": {str(k): {v: 1e3 * s for v, s in p.items()}
                                                           for k, p in preds.items()},
            "ratios": {str(k): r for k, r in ratios.items()},
            "paper": None if paper is None else {"stages": paper[0], "rev_backprop_ms": paper[1], "petra_ms": paper[2],
                                                 "speedup": round(paper[1] / paper[2], 2)}}
        if args.gantt:
            png = os.path.join(args.out_dir, f"timeline_{name}_gantt.png")
            k = args.gantt_k
            plot_gantt(gantt_panels(costs, k, reversible=reversible), png,
                       f"RevNet{depth}, J={J}, k={k}, micro-batch {mbs}, CPU-measured stage costs")
            report["models"][name]["gantt"] = png
            print(f"wrote {png}")
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--validate", metavar="REPORT", help="compare predictions with a throughput report (JSON)")
    parser.add_argument("--uniform", action="store_true", help="uniform costs (--forward/--forward-grad/--backward)")
    parser.add_argument("--stages", type=int, default=4, help="J, with --uniform")
    parser.add_argument("--micro-batches", type=int, default=4, help="k, with --uniform")
    parser.add_argument("--forward", type=float, default=1.0, help="ms, with --uniform")
    parser.add_argument("--forward-grad", type=float, default=1.0, help="ms, with --uniform")
    parser.add_argument("--backward", type=float, default=2.0, help="ms, with --uniform")
    parser.add_argument("--step", type=float, default=0.0, help="ms, with --uniform")
    parser.add_argument("--depths", type=int, nargs="+", default=[18, 34], help="RevNet depths")
    parser.add_argument("--micro-batch", type=int, default=32, help="RevNet micro-batch for the measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 16], help="micro-batches per step to predict")
    parser.add_argument("--gantt-k", type=int, default=4)
    parser.add_argument("--message-s", type=float, default=0.0, help="seconds per message between stages")
    parser.add_argument("--costs-from", help="RevNet: reuse the costs of a previous timeline_revnet.json (no "
                        "measurement); --validate: take the costs from this throughput report")
    parser.add_argument("--no-gantt", dest="gantt", action="store_false", help="skip the Gantt charts")
    parser.add_argument("--out-dir", default=RESULTS)
    parser.add_argument("--name", default=None, help="output file stem (default depends on the mode)")
    args = parser.parse_args(argv)
    args.command = "python -m petra_ds.analysis.timeline " + " ".join(sys.argv[1:] if argv is None else argv)

    if args.validate:
        with open(args.validate) as f:
            report = json.load(f)
        costs = None
        if args.costs_from:
            with open(args.costs_from) as f:
                costs = Costs.from_dict(json.load(f)["costs"])
        result = validate(report, costs=costs)
        print(f"{args.validate}: J = {result['stages']}, k = {result['micro_batches']}, "
              f"micro-batch {result['micro_batch_size']}, DeepSpeed streams {result['ds_streams']}, "
              f"costs from {args.costs_from or args.validate}")
        print(f"{'variant':14s} {'measured/s':>11s} {'predicted/s':>12s} {'error':>7s}")
        for v, r in result["variants"].items():
            print(f"{v:14s} {r['measured_samples_per_s']:11.1f} {r['predicted_samples_per_s']:12.1f} "
                  f"{100 * r['relative_error']:6.1f}%")
        print(f"max |error| {100 * result['max_abs_relative_error']:.1f}% "
              f"({'within' if result['within_tolerance'] else 'OUTSIDE'} {100 * result['tolerance']:.0f}%)"
              + (f"; not modelled: {result['skipped']}" if result["skipped"] else ""))
        stem = args.name or "timeline_validation_" + os.path.splitext(os.path.basename(args.validate))[0]
        result["source"] = args.validate
        result["command"] = args.command
        result["costs_source"] = args.costs_from or args.validate
        if args.gantt:
            png = os.path.join(args.out_dir, stem + "_gantt.png")
            plot_gantt(gantt_panels(Costs.from_dict(result["costs"]), result["micro_batches"]), png,
                       f"{os.path.basename(args.validate)}: J={result['stages']}, k={result['micro_batches']}, "
                       "measured costs")
            result["gantt"] = png
            print(f"wrote {png}")
    elif args.uniform:
        J, k = args.stages, args.micro_batches
        costs = Costs.uniform(J, args.forward / 1e3, args.forward_grad / 1e3, args.backward / 1e3, args.step / 1e3,
                              args.message_s)
        preds = predict(costs, k)
        print(f"uniform costs, J = {J}, k = {k}: forward {args.forward} ms, forward with graph {args.forward_grad} "
              f"ms, backward {args.backward} ms, step {args.step} ms, message {1e3 * args.message_s:g} ms")
        print(_table({k: preds}, 1))
        stem = args.name or f"timeline_uniform_J{J}_k{k}"
        result = {"command": args.command, "stages": J, "micro_batches": k, "costs": costs.to_dict(),
                  "ms_per_micro_batch": {v: 1e3 * s for v, s in preds.items()}}
        if args.gantt:
            png = os.path.join(args.out_dir, stem + "_gantt.png")
            plot_gantt(gantt_panels(costs, k), png,
                       f"uniform costs, J={J}, k={k}: forward {args.forward} ms, with graph {args.forward_grad} ms, "
                       f"backward {args.backward} ms, message {1e3 * args.message_s:g} ms")
            result["gantt"] = png
            print(f"wrote {png}")
    else:
        result = _revnet_report(args)
        stem = args.name or "timeline_revnet"
    path = os.path.join(args.out_dir, stem + ".json")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()

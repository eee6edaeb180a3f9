"""torch.distributed.pipelining's schedules lowered into the simulator's programs, so PETRA's predictions
have torch's pipelines beside DeepSpeed's. What each action costs is in ``programs``' table.

The two-chunk schedules' per-rank action orders are torch's own: the class is built with stand-in
stages (its constructor reads only a stage's index, rank, group size and module, so no process group is
needed) and its ``pipeline_order_with_comms`` is read. ``Schedule1F1B`` runs a loop of its own
(``_step_microbatches``) instead of an action list, and its ``pipeline_order`` does not match that loop
(it starts the last rank at micro-batch 1), so its actions are written here after the loop.

An action is ``(kind, virtual stage, micro-batch)`` in torch's vocabulary: F, B (full backward), I (input
gradient), W (weight gradient), SEND_F/RECV_F/SEND_B/RECV_B (post a send or a receive) and
WAIT_SEND_F/WAIT_SEND_B (wait for a send). The runtime waits for a receive right before the F (RECV_F)
or the B/I (RECV_B) that uses it. A message is keyed by the virtual stage that sends it and the
micro-batch, on the channel between the two ranks, and takes ``message_s``; a hand-over between two
virtual stages of one rank is free (torch passes it in memory). DualPipeV's OVERLAP_F_B runs its forward,
then its backward (torch overlaps them only through a registered custom function). UNSHARD, RESHARD and
the gradient reductions are FSDP's and data parallelism's: nothing to do here. ``step()`` returns without
a collective (the losses stay on the last rank), and every rank then runs its optimizer step.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

from ..schedule import channels
from .costs import Costs
from .simulator import Compute, Endpoint, Mark, Op, Post, Wait

__all__ = ["INPUT_GRAD_SHARE", "SCHEDULES", "TORCH_VARIANTS", "UnsupportedMicroBatches", "placement", "schedule_of",
           "rank_actions", "torch_programs"]

#: variant -> (torch schedule class, virtual stages per rank, V-shaped placement)
SCHEDULES: dict[str, tuple[str, int, bool]] = {
    "torch_1f1b": ("Schedule1F1B", 1, False),
    "torch_interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, False),
    "torch_interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, False),
    "torch_zbv": ("ScheduleZBVZeroBubble", 2, True),
    "torch_dualpipev": ("ScheduleDualPipeV", 2, True),
}
TORCH_VARIANTS = tuple(name + suffix for name in SCHEDULES for suffix in ("", "_ckpt"))

#: the share of a backward that torch's I (input gradient) takes; W (weight gradient) takes the rest.
#: An assumption: the costs hold no measured split
INPUT_GRAD_SHARE = 0.5

Action = tuple[str, int, int]
_COMPUTE = {"F", "B", "I", "W"}
_MESSAGES = {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "WAIT_SEND_F", "WAIT_SEND_B"}
_NOTHING = {"UNSHARD", "RESHARD", "REDUCE_GRAD", "WAIT_REDUCE_GRAD"}


class UnsupportedMicroBatches(ValueError):
    """torch's schedule does not run this many micro-batches on this many ranks."""


def schedule_of(variant: str) -> tuple[str, int, bool, bool]:
    """(torch class, virtual stages per rank, V-shaped, checkpointed) of ``variant``."""
    base = variant.removesuffix("_ckpt")
    if base not in SCHEDULES:
        raise ValueError(f"unknown torch schedule {variant!r}; use one of {', '.join(TORCH_VARIANTS)}")
    return (*SCHEDULES[base], base != variant)


def placement(variant: str, ranks: int) -> dict[int, int]:
    """Virtual stage -> rank: interleaved v -> v mod J, V-shaped v and 2J-1-v -> v (v < J)."""
    _, per_rank, v_shape, _ = schedule_of(variant)
    virtual = ranks * per_rank
    if v_shape:
        return {v: min(v, virtual - 1 - v) for v in range(virtual)}
    return {v: v % ranks for v in range(virtual)}


def _one_f_one_b(stage: int, stages: int, k: int) -> list[Action]:
    """Stage ``stage`` of ``Schedule1F1B``'s loop: min(k, J - stage) forwards, each waiting for the send of
    the one before; then backward/forward pairs, where the sends of one compute and the receive of the
    next go out as one batch that is waited for before that compute; then the remaining backwards, each
    waiting for the send of the one before."""
    first, last = stage == 0, stage == stages - 1
    acts: list[Action] = []

    def add(kind: str, m: int, when: bool = True) -> None:
        if when:
            acts.append((kind, stage, m))

    warmup = min(k, stages - stage)
    for m in range(warmup):
        add("RECV_F", m, not first)
        add("F", m)
        add("WAIT_SEND_F", m - 1, m > 0 and not last)
        add("SEND_F", m, m < warmup - 1 and not last)
    forwards = warmup
    for b in range(k - warmup + 1):
        for kind, m in (("SEND_F", forwards - 1), ("RECV_B", b), ("WAIT_SEND_F", forwards - 1)):
            add(kind, m, not last)
        add("B", b)
        if forwards == k:
            add("SEND_B", b, not first)
            break
        for kind, m in (("SEND_B", b), ("RECV_F", forwards), ("WAIT_SEND_B", b)):
            add(kind, m, not first)
        add("F", forwards)
        forwards += 1
    for b in range(k - warmup + 1, k):
        add("RECV_B", b)
        add("B", b)
        add("WAIT_SEND_B", b - 1, not first)
        add("SEND_B", b, not first)
    add("WAIT_SEND_B", k - 1, not first)
    return acts


@lru_cache(maxsize=64)
def _actions(base: str, ranks: int, k: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions, from one construction of torch's class (it lays out all ranks, and checks k)."""
    cls_name, per_rank, _, _ = schedule_of(base)
    from torch.distributed import pipelining  # here: importing it takes seconds, and only these variants need it

    cls = getattr(pipelining, cls_name)
    virtual = ranks * per_rank
    where = placement(base, ranks)
    stand_ins = [SimpleNamespace(stage_index=v, num_stages=virtual, group_rank=0, group_size=ranks, submod=None)
                 for v in range(virtual) if where[v] == 0]
    try:
        schedule = cls(stand_ins[0] if per_rank == 1 else stand_ins, k)
    except ValueError as e:
        raise UnsupportedMicroBatches(f"{base}: torch's {cls_name} does not run {k} micro-batches on {ranks} "
                                      f"ranks: {e}") from e
    if per_rank == 1:
        return tuple(tuple(_one_f_one_b(r, ranks, k)) for r in range(ranks))
    out = []
    for r in range(ranks):
        acts: list[Action] = []
        for action in schedule.pipeline_order_with_comms[r]:
            for a in action.sub_actions or (action,):
                kind = a.computation_type.value
                if kind in _COMPUTE or kind in _MESSAGES:
                    acts.append((kind, a.stage_index, a.microbatch_index))
                elif kind not in _NOTHING:
                    raise TypeError(f"no cost model for torch's action {a!r}")
        out.append(tuple(acts))
    return tuple(out)


def rank_actions(variant: str, ranks: int, micro_batches: int) -> dict[int, list[Action]]:
    """Each rank's actions for one ``step()`` of ``variant`` (``_ckpt`` changes costs, not actions).

    Raises :class:`UnsupportedMicroBatches` where torch refuses k: ``Schedule1F1B`` needs k >= J,
    DualPipeV k >= 2J, the interleaved ones k a multiple of max(1, k // J); ZBV takes any k."""
    if ranks < 1 or micro_batches < 1:
        raise ValueError(f"need at least one rank and one micro-batch, got {ranks} and {micro_batches}")
    return {r: list(acts) for r, acts in enumerate(_actions(variant.removesuffix("_ckpt"), ranks, micro_batches))}


def _endpoint(kind: str, v: int, micro_batch: int, where: dict[int, int], message_s: float) -> Endpoint | None:
    """The end of the message a SEND_*/RECV_* action of virtual stage ``v`` posts; None between two
    virtual stages of one rank."""
    forward, send = kind.endswith("_F"), kind.startswith("SEND")
    src = v if send else v - 1 if forward else v + 1
    dst = src + 1 if forward else src - 1
    if where[src] == where[dst]:
        return None
    channel = channels.Channel(channels.ACT if forward else channels.GRAD, where[src], where[dst])
    return Endpoint((channel, (src, micro_batch)), send, where[v], message_s)


def torch_programs(variant: str, costs: Costs, micro_batches: int, batches: int) -> dict[int, list[Op]]:
    """``batches`` consecutive ``step()`` calls of ``variant`` on J = ``costs.stage_count`` ranks, each
    followed by the optimizer step. A compute's ``stage`` is its rank (the Gantt row): a two-chunk rank
    runs halves of two measured stages."""
    J, k = costs.stage_count, micro_batches
    _, per_rank, _, checkpointed = schedule_of(variant)
    actions = rank_actions(variant, J, k)
    where = placement(variant, J)
    programs: dict[int, list[Op]] = {}
    for rank in range(J):
        local = [v for v in where if where[v] == rank]
        step = sum(costs.stages[v // per_rank].step for v in local) / per_rank
        program: list[Op] = []
        for b in range(batches):
            posted: dict[tuple[str, int, int], Endpoint] = {}
            for kind, v, m in actions[rank]:
                c, mb = costs.stages[v // per_rank], b * k + m
                if kind in _MESSAGES:
                    if kind.startswith("WAIT"):
                        program.append(Wait((posted.pop((kind[len("WAIT_"):], v, m)),)))
                        continue
                    ep = _endpoint(kind, v, mb, where, costs.message_s)
                    if ep is not None:
                        program.append(Post(ep))
                        posted[(kind, v, m)] = ep
                    continue
                if kind == "W":
                    share = (1.0 - INPUT_GRAD_SHARE) / per_rank
                    program.append(Compute(rank, "backward_weight", mb, share * c.backward))
                    continue
                received = posted.pop(("RECV_F" if kind == "F" else "RECV_B", v, m), None)
                if received is not None:
                    program.append(Wait((received,)))
                if kind == "F":
                    program.append(Compute(rank, "forward_grad", mb, c.forward_grad / per_rank))
                    continue
                if checkpointed:
                    program.append(Compute(rank, "recompute", mb, c.forward_grad / per_rank))
                op, share = ("backward", 1.0) if kind == "B" else ("backward_input", INPUT_GRAD_SHARE)
                program.append(Compute(rank, op, mb, share * c.backward / per_rank))
            program += [Compute(rank, "step", None, step), Mark(b)]
        programs[rank] = program
    return programs

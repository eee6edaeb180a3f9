"""The event simulator: every rank runs its program of compute and non-blocking messages against the
others. It knows no schedule, so PETRA's and DeepSpeed's pipelines, lowered by ``programs``, are timed
by the same rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

__all__ = ["HOLDS", "RELEASES", "Compute", "DeadlockError", "Endpoint", "Event", "Mark", "Op", "Post", "Simulation",
           "Wait", "simulate"]


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


#: the compute ops after which a stage keeps a micro-batch's activations, and those that free them
HOLDS, RELEASES = ("forward", "forward_grad"), ("backward", "backward_weight")


@dataclass
class Simulation:
    """What ran where and when; ``rank_ends[r][w]``: when rank r returned from batch ``w``."""

    events: list[Event]
    rank_ends: dict[int, list[float]]
    stage_count: int
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

    def held_micro_batches(self) -> dict[int, int]:
        """Per rank, the most micro-batches whose activations it held at once: each is held from the end
        of its forward on a stage to the end of the backward that frees it there (a zero-bubble split
        frees it at its weight pass). A stage that reconstructs its inputs (PETRA's reversible middle
        stages) holds nothing. The counts follow from each schedule's order of operations, not from the
        costs, as long as every compute costs more than 0 (one of 0 seconds leaves no event)."""
        rebuilding = {e.stage for e in self.events if e.op == "reconstruct"}
        held = {r: 0 for r in self.rank_ends}
        most = dict(held)
        for e in self.events:
            if e.stage in rebuilding:
                continue
            if e.op in HOLDS:
                held[e.rank] += 1
                most[e.rank] = max(most[e.rank], held[e.rank])
            elif e.op in RELEASES:
                held[e.rank] -= 1
        return most


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

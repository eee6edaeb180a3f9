"""Replay recorded communication traces under NCCL's rules (docs/design/nccl.md), without a GPU.

CI runs gloo, which forgives what NCCL does not: a receive queued ahead of the send it must progress
with, pairing that relies on tags, a first call on a group that leaves ranks out. Multi-rank NCCL cannot
run on one GPU, so the recorder of :mod:`petra_ds.runtime.transport` writes every rank's issue order and this
module plays it back under a conservative model of NCCL, so that a trace that passes here is safe there:

- each rank has one in-order queue for all its communication (all communicators share it: progress
  across communicators is not guaranteed, NVIDIA/nccl#783); only the head of the queue is launched;
- the CPU issues batches and collectives without blocking and stops at a ``wait`` until that event is done;
- tags are ignored: the n-th send from a to b on a group pairs with the n-th receive at b from a there;
- a p2p op transfers once it and its partner are both in launched batches (the ops of one batch progress
  independently, like one fused ncclGroupStart/End launch); a batch is done when all its ops are;
- a collective completes when every rank of its group has its matching one (by position) at its head;
- the first call on a group that p2p batches use must involve all its ranks (torch's batch_isend_irecv).
The replay runs to a fixed point; progress is monotone, so the state where it stops is *the* first hang.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

Event = dict[str, Any]
Traces = dict[int, list[Event]]

__all__ = ["NcclHang", "NcclPairingError", "NcclReplayError", "NcclReplayReport", "NcclRuleError",
           "load_traces", "replay_nccl"]


class NcclReplayError(AssertionError):
    """A trace that would not run safely on NCCL."""


class NcclHang(NcclReplayError):
    """No rank can make progress, yet some have communication left."""


class NcclPairingError(NcclReplayError):
    """The n-th send and the n-th receive of a pair (or the n-th collectives of a group) disagree."""


class NcclRuleError(NcclReplayError):
    """A malformed trace, or a first call on a group that leaves some of its ranks out."""


@dataclass
class NcclReplayReport:
    """Counts per rank, and the deepest queue of issued-but-unfinished events each rank reached."""

    events: dict[int, int] = field(default_factory=dict)
    batches: dict[int, int] = field(default_factory=dict)
    collectives: dict[int, int] = field(default_factory=dict)
    waits: dict[int, int] = field(default_factory=dict)
    p2p_ops: dict[int, int] = field(default_factory=dict)
    max_queue_depth: dict[int, int] = field(default_factory=dict)
    transfers: int = 0  # matched send/recv pairs


def load_traces(directory: str | Path) -> Traces:
    """The traces the recorder wrote: ``trace-rank{R}.json`` files, each a JSON list of events."""
    traces: Traces = {}
    for path in sorted(Path(directory).glob("trace-rank*.json")):
        match = re.fullmatch(r"trace-rank(\d+)\.json", path.name)
        if match:
            traces[int(match.group(1))] = json.loads(path.read_text())
    if not traces:
        raise FileNotFoundError(f"no trace-rank<R>.json files in {directory}")
    return dict(sorted(traces.items()))


def replay_nccl(traces: Mapping[int, Sequence[Event]], *,
                independent_communicators: bool = False) -> NcclReplayReport:
    """Replay every rank's events; raise :class:`NcclReplayError` where NCCL would hang or mis-pair.

    ``independent_communicators=True`` gives each (rank, group) its own queue instead of one per rank:
    an assumption the transport's rules forbid unless a design says it relies on it (tests use it to show
    what the conservative model catches)."""
    return _NcclReplay(traces, independent_communicators).run()


def _group(event: Event) -> tuple[int, ...]:
    return tuple(event["group"])


def _describe(index: int, event: Event) -> str:
    name = event["op"] if event["op"] == "batch" else event.get("kind", event["op"])
    return (f"event #{index} {name} '{event.get('what', '')}' (clock {event.get('clock')}, "
            f"stages {event.get('stages')}, group {list(event.get('group', []))})")


def _describe_op(op: dict) -> str:
    direction = "to" if op["kind"] == "send" else "from"
    return f"{op['kind']} {op.get('channel', '?')} {direction} rank {op['peer']} ({op['numel']} {op['dtype']})"


class _NcclReplay:
    def __init__(self, traces: Mapping[int, Sequence[Event]], independent: bool) -> None:
        self.traces = {int(r): list(events) for r, events in traces.items()}
        self.independent = independent
        self.cpu = {r: 0 for r in self.traces}
        self.queues: dict[int, dict[Any, deque[int]]] = {r: defaultdict(deque) for r in self.traces}
        self.done: dict[int, set[int]] = {r: set() for r in self.traces}
        self.pending: dict[tuple[int, int], set[int]] = {}  # (rank, batch event) -> ops not yet transferred
        self.counts: dict[tuple, int] = defaultdict(int)  # (kind, group, src, dst) or (rank, group) -> issued
        self.slots: dict[tuple, dict[str, tuple[int, int, int]]] = defaultdict(dict)  # pair slot -> ends
        self.op_slot: dict[tuple[int, int, int], tuple] = {}
        self.coll_slot: dict[tuple[int, int], tuple] = {}  # (rank, event) -> (group, n)
        self.coll_events: dict[tuple, dict[int, int]] = defaultdict(dict)  # (group, n) -> rank -> event
        self.report = NcclReplayReport()
        self.validate()
        self.check_first_calls()

    # --- static checks ---

    def validate(self) -> None:
        for r, events in self.traces.items():
            for i, e in enumerate(events):
                problem = self.malformed(r, i, e)
                if problem:
                    raise NcclRuleError(f"malformed trace: rank {r} event #{i} {e}: {problem}")

    def malformed(self, rank: int, index: int, e: Event) -> str | None:
        if e.get("op") == "wait":
            ref = e.get("ref")
            ok = isinstance(ref, int) and 0 <= ref < index and self.traces[rank][ref].get("op") != "wait"
            return None if ok else "a wait must refer to an earlier batch or collective"
        if e.get("op") not in ("batch", "collective"):
            return "unknown op"
        group = list(e.get("group", []))
        if rank not in group or group != sorted(set(group)) or not set(group) <= set(self.traces):
            return "a group is sorted, holds its rank and only ranks that have a trace"
        if any(op.get("kind") not in ("send", "recv") or op.get("peer") not in group
               or "numel" not in op or "dtype" not in op for op in e.get("ops", [])):
            return "an op lacks a kind, numel, dtype or a peer in the group"
        return None

    def check_first_calls(self) -> None:
        """torch's batch_isend_irecv rule: where a rank's first call on a p2p group is a batch, every rank
        of the group must make a batch its first call there too (one collective communicator init)."""
        groups = {_group(e) for events in self.traces.values() for e in events if e["op"] == "batch" and e["ops"]}
        for group in sorted(groups):
            firsts = {r: self.first_call(r, group) for r in group}
            batch_first = [r for r in group
                           if firsts[r] is not None and self.traces[r][firsts[r]]["op"] == "batch"]
            if not batch_first or len(batch_first) == len(group):
                continue
            r, other = batch_first[0], next(q for q in group if q not in batch_first)
            theirs = ("nothing on this group" if firsts[other] is None
                      else _describe(firsts[other], self.traces[other][firsts[other]]))
            raise NcclRuleError(
                f"first call on group {list(group)} leaves ranks out: rank {r}'s first call there is "
                f"{_describe(firsts[r], self.traces[r][firsts[r]])}, but rank {other}'s is {theirs}. With NCCL the "
                "first call on a group that batch_isend_irecv uses must involve every rank of it (e.g. a barrier)")

    def first_call(self, rank: int, group: tuple[int, ...]) -> int | None:
        """The rank's first event on ``group`` that reaches NCCL (an empty batch makes no call)."""
        return next((i for i, e in enumerate(self.traces[rank])
                     if e["op"] != "wait" and _group(e) == group and e.get("ops", True)), None)

    # --- the simulation ---

    def run(self) -> NcclReplayReport:
        while True:
            progressed = any([self.issue(r) for r in self.traces])
            progressed |= self.transfer()
            progressed |= self.complete_collectives()
            if all(self.finished(r) for r in self.traces):
                return self.summarise()
            if not progressed:
                raise NcclHang(self.hang_message())

    def finished(self, rank: int) -> bool:
        return self.cpu[rank] == len(self.traces[rank]) and not any(self.queues[rank].values())

    def queue_of(self, rank: int, event: Event) -> deque[int]:
        return self.queues[rank][_group(event) if self.independent else None]

    def at_head(self, rank: int, index: int) -> bool:
        queue = self.queue_of(rank, self.traces[rank][index])
        return bool(queue) and queue[0] == index

    def issue(self, rank: int) -> bool:
        """The CPU walks on until a wait on an unfinished event (or the end of its trace)."""
        events, start = self.traces[rank], self.cpu[rank]
        while self.cpu[rank] < len(events):
            i, e = self.cpu[rank], events[self.cpu[rank]]
            if e["op"] == "wait":
                if e["ref"] not in self.done[rank]:
                    break
            else:
                self.queue_of(rank, e).append(i)
                if e["op"] == "batch":
                    self.register_batch(rank, i, e)
                else:
                    self.register_collective(rank, i, e)
                depth = sum(len(q) for q in self.queues[rank].values())
                self.report.max_queue_depth[rank] = max(self.report.max_queue_depth.get(rank, 0), depth)
            self.cpu[rank] += 1
        return self.cpu[rank] > start

    def register_batch(self, rank: int, index: int, event: Event) -> None:
        self.pending[(rank, index)] = set(range(len(event["ops"])))
        for j, op in enumerate(event["ops"]):
            src, dst = (rank, op["peer"]) if op["kind"] == "send" else (op["peer"], rank)
            count_key = (op["kind"], _group(event), src, dst)
            slot = (_group(event), src, dst, self.counts[count_key])
            self.counts[count_key] += 1
            self.slots[slot][op["kind"]] = (rank, index, j)
            self.op_slot[(rank, index, j)] = slot
            if len(self.slots[slot]) == 2:
                self.check_pair(slot)

    def op_at(self, end: tuple[int, int, int]) -> dict:
        rank, index, j = end
        return self.traces[rank][index]["ops"][j]

    def check_pair(self, slot: tuple) -> None:
        ends = self.slots[slot]["send"], self.slots[slot]["recv"]
        ops = [self.op_at(end) for end in ends]
        if len({(op["numel"], op["dtype"]) for op in ops}) == 1:
            return
        group, src, dst, n = slot
        sides = [f"  rank {r} {_describe(i, self.traces[r][i])}: {_describe_op(op)}"
                 for (r, i, _j), op in zip(ends, ops)]
        raise NcclPairingError("\n".join([
            f"pairing mismatch on group {list(group)}: send #{n + 1} from rank {src} to rank {dst} meets receive "
            f"#{n + 1} there (NCCL ignores tags):", *sides]))

    def register_collective(self, rank: int, index: int, event: Event) -> None:
        group = _group(event)
        slot = (group, self.counts[(rank, group)])
        self.counts[(rank, group)] += 1
        self.coll_slot[(rank, index)] = slot
        self.coll_events[slot][rank] = index
        first = next(iter(self.coll_events[slot].items()))
        other = self.traces[first[0]][first[1]]
        if any(event.get(k) != other.get(k) for k in ("kind", "root", "numel")):
            raise NcclPairingError(
                f"collective mismatch on group {list(group)}, its collective #{slot[1] + 1}:\n  rank {first[0]} "
                f"{_describe(first[1], other)} (root {other.get('root')}, numel {other.get('numel')})\n  rank {rank} "
                f"{_describe(index, event)} (root {event.get('root')}, numel {event.get('numel')})")

    def heads(self, op: str) -> list[tuple[int, int]]:
        return [(r, q[0]) for r in self.traces for q in self.queues[r].values()
                if q and self.traces[r][q[0]]["op"] == op]

    def partner(self, end: tuple[int, int, int]) -> tuple[int, int, int] | None:
        slot = self.op_slot[end]
        return self.slots[slot].get("recv" if self.op_at(end)["kind"] == "send" else "send")

    def transfer(self) -> bool:
        progressed = False
        for rank, index in self.heads("batch"):
            for j in sorted(self.pending[(rank, index)]):
                other = self.partner((rank, index, j))
                if other is not None and self.at_head(other[0], other[1]):
                    self.pending[(rank, index)].discard(j)
                    self.pending[(other[0], other[1])].discard(other[2])
                    self.report.transfers += 1
                    progressed = True
        for rank, index in self.heads("batch"):
            if not self.pending[(rank, index)]:
                self.finish(rank, index)
                progressed = True
        return progressed

    def finish(self, rank: int, index: int) -> None:
        self.queue_of(rank, self.traces[rank][index]).popleft()
        self.done[rank].add(index)

    def complete_collectives(self) -> bool:
        progressed = False
        for rank, index in self.heads("collective"):
            if index in self.done[rank]:
                continue
            members = self.collective_members(self.coll_slot[(rank, index)])
            if all(m is not None and self.at_head(*m) for m in members.values()):
                for member in members.values():
                    self.finish(*member)
                progressed = True
        return progressed

    def collective_members(self, slot: tuple) -> dict[int, tuple[int, int] | None]:
        """Each rank of the group -> its event holding collective ``slot`` (None: not issued yet)."""
        issued = self.coll_events[slot]
        return {q: (q, issued[q]) if q in issued else None for q in slot[0]}

    def summarise(self) -> NcclReplayReport:
        rep = self.report
        for r, events in self.traces.items():
            rep.events[r] = len(events)
            rep.batches[r], rep.collectives[r], rep.waits[r] = (
                sum(e["op"] == op for e in events) for op in ("batch", "collective", "wait"))
            rep.p2p_ops[r] = sum(len(e["ops"]) for e in events if e["op"] == "batch")
            rep.max_queue_depth.setdefault(r, 0)
        return rep

    # --- the hang report ---

    def hang_message(self) -> str:
        lines = ["NCCL hang: no rank can issue, transfer or complete anything (the first stuck state)."]
        for r in self.traces:
            if not self.finished(r):
                lines.extend(self.rank_lines(r))
        if any(line.startswith("  head: event") and " batch '" in line for line in lines):
            lines.append("Only a queue's head is launched: fuse the ops that must progress together in one "
                         "batch_isend_irecv, issued in the same order on every rank (docs/design/nccl.md).")
        return "\n".join(lines)

    def rank_lines(self, rank: int) -> list[str]:
        lines = [f"rank {rank} ({self.cpu_position(rank)}):"]
        for queue in self.queues[rank].values():
            if queue:
                event = self.traces[rank][queue[0]]
                lines.append(f"  head: {_describe(queue[0], event)}; {len(queue) - 1} more queued behind it")
                lines.extend(self.batch_waits(rank, queue[0]) if event["op"] == "batch"
                             else self.collective_waits(rank, queue[0]))
        return lines

    def batch_waits(self, rank: int, index: int) -> list[str]:
        lines = []
        for j in sorted(self.pending[(rank, index)]):
            end, op = (rank, index, j), self.traces[rank][index]["ops"][j]
            group, src, dst, n = self.op_slot[end]
            mate = "recv" if op["kind"] == "send" else "send"
            lines.append(f"    {_describe_op(op)}, the pair's #{n + 1} on group {list(group)}")
            where = self.whereabouts(op["peer"], self.partner(end))
            lines.append(f"      waits for rank {op['peer']}'s {mate} #{n + 1}: {where}")
        return lines

    def collective_waits(self, rank: int, index: int) -> list[str]:
        slot = self.coll_slot[(rank, index)]
        return [f"    the group's collective #{slot[1] + 1} waits for rank {q}: {self.whereabouts(q, m)}"
                for q, m in self.collective_members(slot).items() if m is None or not self.at_head(*m)]

    def whereabouts(self, rank: int, end: tuple | None) -> str:
        """Where the peer's matching op stands: not issued yet, or issued behind another head."""
        if end is None:
            return f"not issued yet (that rank's {self.cpu_position(rank)})"
        queue = self.queue_of(rank, self.traces[rank][end[1]])
        return (f"issued in its {_describe(end[1], self.traces[rank][end[1]])}, queued behind its head "
                f"event #{queue[0]}")

    def cpu_position(self, rank: int) -> str:
        events, pos = self.traces[rank], self.cpu[rank]
        if pos < len(events):
            return f"CPU blocked at event #{pos}, a wait on event #{events[pos]['ref']}"
        return f"CPU has issued all its {len(events)} events"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m petra_ds.verify.nccl_replay DIR``: replay the traces a run wrote with ``PETRA_DS_COMM_TRACE=DIR``."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("directory", help="where the ranks wrote trace-rank<R>.json")
    args = parser.parse_args(argv)
    try:
        report = replay_nccl(load_traces(args.directory))
    except NcclReplayError as error:
        print(f"{type(error).__name__}: {error}")
        return 1
    print(f"safe under NCCL's rules: {len(report.events)} ranks, {sum(report.batches.values())} batches, "
          f"{sum(report.collectives.values())} collectives, {report.transfers} transfers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The communication trace the engine's OLD posting issued, lowered from PETRA's instruction streams.

The negative control of :mod:`petra_ds.verify.nccl_replay`. Before the transport of docs/design/nccl.md, the
engine posted every cross-rank receive of a clock as its own ``irecv`` at the clock's start, every send as
its own ``isend`` right after the compute that produced it, and waited for all of them at the clock's
``CommitP2P``; a channel's first message went at the commit instead, after its layout header, each in a
blocking batch. On NCCL a receive queued ahead of the send its peer is waiting for hangs
(pytorch/pytorch#109401). ``grouped=True`` lowers the same messages as one batch per rank and clock: the
positive control of the lowering. Models with tied weights are not lowered (their messages are left out).
"""

from __future__ import annotations

from typing import Any

from petra_ds.schedule import channels
from petra_ds.schedule.channels import channel_name
from petra_ds.verify.replay import streams_for
from petra_ds.schedule import CommitP2P, RecvActivation, RecvGrad, SendActivation, SendGrad, Timeline, Window

#: fixed message sizes per channel kind (distinct, so that a mis-pairing shows)
NUMEL = {"act": 1024, "grad": 2048, "header": 512}


def legacy_trace(num_ranks: int, stages_per_rank: int, windows: int, k: int, reversible: bool, *,
                 grouped: bool = False) -> dict[int, list[dict[str, Any]]]:
    """Every rank's trace for ``windows`` train_batch windows of ``k`` clocks, then the drain."""
    num_stages = num_ranks * stages_per_rank
    streams = streams_for(petra_windows(num_stages, windows, k), pipeline_ranks=num_ranks,
                          stages_per_rank=stages_per_rank, gradient_accumulation_steps=k,
                          reversible=[reversible] * num_stages)
    return {rank: _Lowering(rank, num_ranks, stages_per_rank, grouped).lower(clocks)
            for rank, clocks in streams.items()}


def petra_windows(num_stages: int, windows: int, k: int) -> list[Window]:
    timeline = Timeline(num_stages)
    out = []
    for _ in range(windows):
        out.append(timeline.train_window(k))
        timeline.advance(out[-1])
    out.append(timeline.drain_window())
    return out


def message_of(cmd: Any) -> tuple[str, int, int] | None:
    """The channel (kind, source stage, destination stage) a send or receive instruction uses."""
    s = getattr(cmd, "stage", None)
    if s is None:
        return None
    return {SendActivation: channels.forward_channel(s), RecvActivation: channels.forward_channel(s - 1),
            SendGrad: channels.backward_channel(s), RecvGrad: channels.backward_channel(s + 1)}.get(type(cmd))


class _Lowering:
    def __init__(self, rank: int, num_ranks: int, stages_per_rank: int, grouped: bool) -> None:
        self.rank, self.S, self.grouped = rank, stages_per_rank, grouped
        self.world = list(range(num_ranks))
        self.local = list(range(rank * stages_per_rank, (rank + 1) * stages_per_rank))
        self.events: list[dict[str, Any]] = []
        self.negotiated: set[tuple[str, int, int]] = set()
        self.clock = 0

    def lower(self, clocks: list[list[Any]]) -> list[dict[str, Any]]:
        self.events.append({"op": "collective", "kind": "barrier", "group": self.world, "root": None,
                            "numel": None, "clock": None, "stages": self.local, "what": "engine start"})
        self.events.append({"op": "wait", "ref": 0})
        for clock, cmds in enumerate(clocks):
            self.clock = clock
            self.lower_clock(cmds)
        return self.events

    def lower_clock(self, cmds: list[Any]) -> None:
        """The old schedule listed a clock's receives first: they are posted before any compute."""
        is_recv = [isinstance(c, (RecvActivation, RecvGrad)) for c in cmds]
        ordered = [c for c, r in zip(cmds, is_recv) if r] + [c for c, r in zip(cmds, is_recv) if not r]
        posted: list[int] = []
        queued: list[tuple[str, tuple[str, int, int]]] = []
        for cmd in ordered:
            channel = message_of(cmd)
            if channel is not None and self.peer(channel, cmd) != self.rank:
                kind = "send" if isinstance(cmd, (SendActivation, SendGrad)) else "recv"
                if self.grouped or channel not in self.negotiated:
                    queued.append((kind, channel))
                else:
                    posted.append(self.batch([self.op(kind, channel)], f"posted {kind} {channel_name(channel)}"))
            elif isinstance(cmd, CommitP2P):
                self.commit(queued, posted)
                queued, posted = [], []

    def peer(self, channel: tuple[str, int, int], cmd: Any) -> int:
        other = channel[2] if isinstance(cmd, (SendActivation, SendGrad)) else channel[1]
        return other // self.S

    def op(self, kind: str, channel: tuple[str, int, int], header: bool = False) -> dict[str, Any]:
        peer = (channel[2] if kind == "send" else channel[1]) // self.S
        name = channel_name(channel)
        return {"kind": kind, "peer": peer, "numel": NUMEL["header" if header else channel[0]],
                "dtype": "int64" if header else "float32", "channel": f"header:{name}" if header else name}

    def batch(self, ops: list[dict[str, Any]], what: str) -> int:
        self.events.append({"op": "batch", "group": self.world, "ops": ops, "clock": self.clock,
                            "stages": self.local, "what": what})
        return len(self.events) - 1

    def blocking_batch(self, ops: list[dict[str, Any]], what: str) -> None:
        if ops:
            self.events.append({"op": "wait", "ref": self.batch(ops, what)})

    def commit(self, queued: list[tuple[str, tuple[str, int, int]]], posted: list[int]) -> None:
        """The old ``_exchange``: headers of new channels, then the queued data, sends before receives,
        each a blocking batch; then the waits on what was posted during the clock."""
        ordered = [q for q in queued if q[0] == "send"] + [q for q in queued if q[0] == "recv"]
        if not self.grouped:
            self.blocking_batch([self.op(kind, ch, header=True) for kind, ch in ordered], "layout headers")
            self.negotiated.update(ch for _kind, ch in ordered)
        self.blocking_batch([self.op(kind, ch) for kind, ch in ordered], "commit exchange")
        self.events.extend({"op": "wait", "ref": ref} for ref in posted)

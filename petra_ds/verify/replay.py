"""Replay every rank's PETRA instruction stream without torch.distributed, and check it.

Each rank walks its own list of clocks at its own pace; sends and receives are queued, a ``PostP2P``
delivers the sends queued so far and a ``CommitP2P`` delivers the rest and then waits for the queued
receives (the engine waits for its posted batches at the commit: the same pairing). A rank that waits
for a message nobody will send is a deadlock. Whether the order in which a rank issues its batches is
safe on NCCL is :mod:`petra_ds.verify.nccl_replay`'s question, asked of recorded traffic. Along the way the replay
checks the PETRA semantics: one forward and one backward per micro-batch and stage, the delay
``2(J-1-j)``, messages that travel exactly one clock, input FIFOs only where a stage cannot
reconstruct, and an optimizer step after every k-th backward of a stage, after its compute of that
clock. It re-derives, on purpose, what each compute instruction must consume and produce (from the stage's
position and whether it reconstructs) and the tied messages of each step, and fails where the streams say
otherwise: an independent check of the schedule's one derivation, not a second source of it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from deepspeed.runtime.pipe.schedule import PipeInstruction

from ..schedule import (AccumulateAndStep, CommitP2P, DelayedBackward, ForwardPass, LoadMicroBatch, PetraSchedule,
                        PostP2P, ReverseReconstruct, Window, channels, delay, reconstructs)
from ..schedule.instructions import BACKWARD, FORWARD, LOAD, STEP

#: the compute phases of a clock, in the order a rank must run them
COMPUTE_PHASES = (LOAD, FORWARD, BACKWARD, STEP)


class ScheduleError(AssertionError):
    """An instruction stream that deadlocks or breaks PETRA's semantics."""


@dataclass
class ReplayReport:
    """What happened, for the checks a caller wants to add."""

    forward_clock: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage, mb) -> clock
    backward_clock: dict[tuple[int, int], int] = field(default_factory=dict)
    steps: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))  # stage -> clocks
    max_fifo: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # stage -> depth
    fifo: dict[int, deque] = field(default_factory=lambda: defaultdict(deque))
    raw: set[int] = field(default_factory=set)  # micro-batches stage 0 still holds
    in_transit: int = 0
    #: (reader, key) -> the owner steps whose weights the reader received, in order
    tied_weights: dict[tuple[int, str], list[int]] = field(default_factory=dict)

    def backwards(self, stage: int) -> int:
        return sum(1 for (j, _m) in self.backward_clock if j == stage)

    def assert_drained(self) -> None:
        """Nothing is in flight: every forward has had its backward, no buffer or message is held."""
        missing = sorted(set(self.forward_clock) - set(self.backward_clock))
        if missing:
            raise ScheduleError(f"forwards without a backward after the drain: {missing[:5]}")
        held = {j: list(q) for j, q in self.fifo.items() if q}
        if held or self.raw or self.in_transit:
            raise ScheduleError(
                f"state left after the drain: fifo={held} raw={sorted(self.raw)} messages={self.in_transit}"
            )


def streams_for(
    windows: Sequence[Window],
    *,
    pipeline_ranks: int,
    stages_per_rank: int,
    gradient_accumulation_steps: int,
    reversible: Sequence[bool] | None = None,
    ties: Sequence[tuple[str, int, Sequence[int]]] = (),
    input_buffer: str = "non_reversible",
) -> dict[int, list[list[PipeInstruction]]]:
    """Every rank's instruction lists for consecutive windows, as the engine would run them."""
    streams: dict[int, list[list[PipeInstruction]]] = {}
    for rank in range(pipeline_ranks):
        streams[rank] = [
            clock_cmds
            for window in windows
            for clock_cmds in PetraSchedule.for_window(
                window, pipeline_ranks, rank, stages_per_rank=stages_per_rank,
                gradient_accumulation_steps=gradient_accumulation_steps, reversible=reversible, ties=ties,
                input_buffer=input_buffer)
        ]
    return streams


def replay(
    streams: Mapping[int, Sequence[Sequence[PipeInstruction]]],
    *,
    petra_stages: int,
    stages_per_rank: int,
    gradient_accumulation_steps: int,
    reversible: Sequence[bool] | None = None,
    start_clock: int = 0,
    ties: Sequence[tuple[str, int, Sequence[int]]] = (),
    input_buffer: str = "non_reversible",
) -> ReplayReport:
    """Replay ``streams[rank]`` (a list of per-clock instruction lists starting at ``start_clock``).

    With ``ties`` ``(key, owner, readers)`` it also checks the tied-weight traffic: every reader sends
    its gradient at its own step, the owner has all of them before it steps, and every reader receives
    the weights of every owner step in the clock the owner took it."""
    return _Replay(streams, petra_stages, stages_per_rank, gradient_accumulation_steps,
                   reversible, start_clock, ties, input_buffer).run()


class _Replay:
    def __init__(self, streams, petra_stages, stages_per_rank, k, reversible, start_clock, ties=(),
                 input_buffer="non_reversible"):
        self.streams = {rank: [list(c) for c in clocks] for rank, clocks in streams.items()}
        self.J = petra_stages
        self.S = stages_per_rank
        self.k = k
        self.reversible = tuple(reversible) if reversible is not None else (False,) * petra_stages
        self.input_buffer = input_buffer
        self.start = start_clock
        self.report = ReplayReport()
        # channel (kind, src_stage, dst_stage) -> deque of (micro_batch, send_clock, with_input)
        self.channels: dict[tuple, deque] = defaultdict(deque)
        self.pos = {rank: (0, 0) for rank in self.streams}
        self.queued_sends: dict[int, list] = defaultdict(list)
        self.queued_recvs: dict[int, list] = defaultdict(list)
        #: per rank, the messages its stages sent each other this clock: handed over at its commit, unreceived
        self.handed: dict[int, list] = defaultdict(list)
        self.committing: set[int] = set()
        # (stage, kind, mb) -> clock at which the message was received (usable at clock + 1)
        self.inbox: dict[channels.Key, int] = {}
        #: per producing stage, what it produced and has not sent yet (by the receiver's key) -> clock
        self.outbox: dict[int, dict[channels.Key, int]] = defaultdict(dict)
        self.tape: dict[int, tuple[int, int]] = {}  # stage -> (mb, clock) of a reconstruction
        self.graph: dict[int, tuple[int, int]] = {}  # last stage's live graph
        self.done_this_clock: dict[int, int] = {}  # stage -> clock of its last step
        self.ties = {key: (owner, tuple(readers)) for key, owner, readers in ties}
        self.phase_reached: dict[int, tuple[int, int]] = {}  # rank -> (clock, latest compute phase run)

    def reconstructs(self, j: int) -> bool:
        return reconstructs(j, self.J, self.reversible[j], self.input_buffer)

    def fail(self, rank: int, clock: int, cmd, msg: str):
        raise ScheduleError(f"rank {rank}, clock {clock}, {cmd!r}: {msg}")

    def run(self) -> ReplayReport:
        for rank in self.streams:
            expected = range(rank * self.S, (rank + 1) * self.S)
            for clock_cmds in self.streams[rank]:
                for cmd in clock_cmds:
                    stage = cmd.stage
                    if stage is not None and stage not in expected:
                        raise ScheduleError(f"rank {rank} runs {cmd!r} for a stage it does not host")
        while True:
            progressed = False
            for rank in self.streams:
                progressed |= self.advance(rank)
            if all(self.finished(r) for r in self.streams):
                break
            if not progressed:
                waiting = {r: self.waiting_for(r) for r in self.streams if not self.finished(r)}
                raise ScheduleError(f"deadlock: {waiting}")
        self.report.in_transit = sum(len(q) for q in self.channels.values())
        self.report.in_transit += sum(len(o) for o in self.outbox.values())
        self.report.in_transit += sum(len(v) for v in self.queued_sends.values()) + len(self.inbox)
        self.report.in_transit += sum(len(v) for v in self.handed.values())
        return self.report

    def finished(self, rank: int) -> bool:
        return self.pos[rank][0] >= len(self.streams[rank])

    def waiting_for(self, rank: int) -> str:
        clock_idx, _ = self.pos[rank]
        return f"clock {self.start + clock_idx}: {self.queued_recvs[rank]!r}"

    def advance(self, rank: int) -> bool:
        progressed = False
        stream = self.streams[rank]
        while not self.finished(rank):
            clock_idx, cmd_idx = self.pos[rank]
            cmds = stream[clock_idx]
            if cmd_idx >= len(cmds):
                self.end_clock(rank, self.start + clock_idx)
                self.pos[rank] = (clock_idx + 1, 0)
                progressed = True
                continue
            cmd = cmds[cmd_idx]
            if not self.execute(rank, self.start + clock_idx, cmd):
                return progressed
            self.pos[rank] = (clock_idx, cmd_idx + 1)
            progressed = True
        return progressed

    def end_clock(self, rank: int, clock: int) -> None:
        if self.queued_sends[rank] or self.queued_recvs[rank] or self.handed[rank]:
            raise ScheduleError(f"rank {rank} ends clock {clock} with uncommitted p2p operations")
        for j in range(rank * self.S, (rank + 1) * self.S):
            if j in self.tape:
                raise ScheduleError(f"stage {j} reconstructed micro-batch {self.tape[j][0]} at clock "
                                    f"{clock} without a backward")
            if j in self.graph:
                raise ScheduleError(f"last stage kept the graph of micro-batch {self.graph[j][0]} past "
                                    f"clock {clock}")
            stale = [key for key, c in self.outbox[j].items() if c <= clock]
            if stale:
                raise ScheduleError(f"stage {j} produced {stale} at clock {clock} and never sent them")

    # --- instructions ---

    def execute(self, rank: int, clock: int, cmd) -> bool:
        """Run ``cmd``; False when it must wait (only a commit can). A rank's compute runs in the order of
        its instructions' phases within a clock (load, forward, backward, step)."""
        done = self.run_instruction(rank, clock, cmd)
        if cmd.phase in COMPUTE_PHASES:
            seen_clock, latest = self.phase_reached.get(rank, (clock, 0))
            latest = latest if seen_clock == clock else 0
            phase = COMPUTE_PHASES.index(cmd.phase)
            if phase < latest:
                self.fail(rank, clock, cmd, f"a {cmd.phase} after the {COMPUTE_PHASES[latest]} phase of its clock")
            self.phase_reached[rank] = (clock, phase)
        return done

    def run_instruction(self, rank: int, clock: int, cmd) -> bool:
        r = self.report
        if isinstance(cmd, LoadMicroBatch):
            j, m = cmd.stage, cmd.micro_batch
            if j != 0:
                self.fail(rank, clock, cmd, "only stage 0 reads data")
            if m != clock:
                self.fail(rank, clock, cmd, f"micro-batch {m} must enter stage 0 at clock {m}")
            r.raw.add(m)
        elif isinstance(cmd, ForwardPass):
            self.forward(rank, clock, cmd)
        elif isinstance(cmd, ReverseReconstruct):
            j, m = cmd.stage, cmd.micro_batch
            if not self.reconstructs(j):
                self.fail(rank, clock, cmd, "this stage cannot reconstruct its input")
            self.expect(rank, clock, cmd, channels.backward_key(j + 1, m), None)
            self.take(rank, clock, cmd, cmd.consumes)
            self.tape[j] = (m, clock)
        elif isinstance(cmd, DelayedBackward):
            self.backward(rank, clock, cmd)
        elif isinstance(cmd, AccumulateAndStep):
            j = cmd.stage
            r.steps[j].append(clock)
            if r.backwards(j) != cmd.step * self.k:
                self.fail(rank, clock, cmd, f"stage {j} has run {r.backwards(j)} backwards, not "
                          f"{cmd.step} x k = {cmd.step * self.k}")
            self.done_this_clock[j] = clock
            for key, (owner, readers) in self.ties.items():
                if j in readers:
                    self.outbox[j][channels.tied_grad_key(owner, key, j, cmd.step)] = clock
                if j == owner:
                    for reader in readers:
                        self.take(rank, clock, cmd, channels.tied_grad_key(j, key, reader, cmd.step),
                                  any_earlier_clock=True)
                        self.outbox[j][channels.tied_weight_key(reader, key, cmd.step)] = clock
        elif cmd.sends is True:
            self.queue_send(rank, clock, cmd)
        elif cmd.sends is False:
            if cmd.channel().src // self.S == rank:
                self.fail(rank, clock, cmd, "a receive from a stage of this rank, whose messages are handed over "
                          "at the commit")
            self.queued_recvs[rank].append((cmd.channel(), cmd.key(), cmd.with_input, cmd))
        elif isinstance(cmd, PostP2P):
            for channel, message in self.queued_sends.pop(rank, []):
                self.channels[channel].append(message)
        elif isinstance(cmd, CommitP2P):
            return self.commit(rank, clock)
        else:
            self.fail(rank, clock, cmd, "unknown instruction")
        return True

    def check_not_stepped(self, rank, clock, cmd):
        if self.done_this_clock.get(cmd.stage) == clock:
            self.fail(rank, clock, cmd, "compute after the stage's optimizer step in the same clock")

    def take(self, rank, clock, cmd, key, any_earlier_clock=False):
        """Consume a message that must have been received at the previous clock (``any_earlier_clock``:
        at any earlier clock, for a tied gradient waiting for the owner's step)."""
        received = self.inbox.pop(key, None)
        if received is None:
            self.fail(rank, clock, cmd, f"no {key[1]} message for micro-batch {key[2]} was received")
        if any_earlier_clock:
            if received >= clock:
                self.fail(rank, clock, cmd, f"{key[1]} of step {key[2]} received at clock {received}, needed earlier")
        elif received != clock - 1:
            self.fail(rank, clock, cmd, f"message received at clock {received}, used at {clock}: "
                      "messages travel exactly one clock")

    def expect(self, rank, clock, cmd, consumes, produces) -> None:
        """The instruction consumes and produces what its stage's position says (derived here again)."""
        if (cmd.consumes, cmd.produces) != (consumes, produces):
            self.fail(rank, clock, cmd, f"consumes {cmd.consumes} and produces {cmd.produces}; its stage "
                      f"consumes {consumes} and produces {produces}")

    def first(self, rank, clock, cmd, done: dict, what: str) -> tuple[int, int]:
        """(stage, micro-batch) of a compute that must come before the stage's step and only once."""
        self.check_not_stepped(rank, clock, cmd)
        if (cmd.stage, cmd.micro_batch) in done:
            self.fail(rank, clock, cmd, f"second {what} of this micro-batch at this stage")
        return cmd.stage, cmd.micro_batch

    def forward(self, rank, clock, cmd):
        r = self.report
        j, m = self.first(rank, clock, cmd, r.forward_clock, "forward")
        if m + j != clock:
            self.fail(rank, clock, cmd, f"forward of micro-batch {m} at stage {j} belongs to clock {m + j}")
        produces = channels.forward_key(j, m) if j < self.J - 1 else None
        if j == 0:
            self.expect(rank, clock, cmd, channels.data_key(m), produces)
            if m not in r.raw:
                self.fail(rank, clock, cmd, "stage 0 forward before its micro-batch was loaded")
        else:
            self.expect(rank, clock, cmd, channels.forward_key(j - 1, m), produces)
            self.take(rank, clock, cmd, cmd.consumes)
        r.forward_clock[(j, m)] = clock
        if j == self.J - 1:
            self.graph[j] = (m, clock)
        elif j > 0 and not self.reconstructs(j):
            r.fifo[j].append(m)
            r.max_fifo[j] = max(r.max_fifo[j], len(r.fifo[j]))
        if cmd.produces is not None:
            self.outbox[j][cmd.produces] = clock

    def backward(self, rank, clock, cmd):
        r = self.report
        j, m = self.first(rank, clock, cmd, r.backward_clock, "backward")
        if (j, m) not in r.forward_clock:
            self.fail(rank, clock, cmd, "backward before forward")
        expected = r.forward_clock[(j, m)] + delay(j, self.J)
        if clock != expected:
            self.fail(rank, clock, cmd, f"backward at clock {clock}, expected forward + 2(J-1-j) = {expected}")
        recomputes = j < self.J - 1 and not self.reconstructs(j)
        self.expect(rank, clock, cmd, channels.backward_key(j + 1, m) if recomputes else None,
                    channels.backward_key(j, m) if j > 0 else None)
        if j == self.J - 1:
            if self.graph.pop(j, None) != (m, clock):
                self.fail(rank, clock, cmd, "last stage backward without its forward in this clock")
        elif self.reconstructs(j):
            if self.tape.pop(j, None) != (m, clock):
                self.fail(rank, clock, cmd, "reversible stage backward without its reconstruction")
        else:
            self.take(rank, clock, cmd, cmd.consumes)
        if j == 0:
            if m not in r.raw:
                self.fail(rank, clock, cmd, "stage 0 lost its raw micro-batch")
            r.raw.discard(m)
        elif j < self.J - 1 and not self.reconstructs(j):
            if not r.fifo[j] or r.fifo[j][0] != m:
                self.fail(rank, clock, cmd, f"FIFO head is {list(r.fifo[j])[:1]}, not micro-batch {m}")
            r.fifo[j].popleft()
        r.backward_clock[(j, m)] = clock
        if cmd.produces is not None:
            self.outbox[j][cmd.produces] = clock

    def queue_send(self, rank, clock, cmd):
        """A send of a message its stage produced at this clock (a result of its compute or its step)."""
        channel, key, with_input = cmd.channel(), cmd.key(), cmd.with_input
        if self.outbox[cmd.stage].pop(key, None) != clock:
            self.fail(rank, clock, cmd, "sends a message not produced at this clock")
        if not 0 <= channel.dst < self.J:
            self.fail(rank, clock, cmd, f"no stage {channel.dst} to send to")
        if channel.kind == channels.GRAD and with_input != self.reconstructs(channel.dst):
            self.fail(rank, clock, cmd, f"with_input={with_input} but stage {channel.dst} "
                      f"{'needs' if self.reconstructs(channel.dst) else 'does not need'} x~")
        if channel.dst // self.S == rank:
            self.handed[rank].append((channel, key))
        else:
            self.queued_sends[rank].append((channel, (key, clock, with_input)))

    def commit(self, rank, clock) -> bool:
        if rank not in self.committing:
            for channel, message in self.queued_sends.pop(rank, []):
                self.channels[channel].append(message)
            self.committing.add(rank)
        pending = self.queued_recvs[rank]
        for channel, key, _with_input, cmd in pending:
            queue = self.channels[channel]
            if not queue:
                return False
            if queue[0][0] != key:
                self.fail(rank, clock, cmd, f"expected {key.kind} {key.index}, the channel delivers "
                          f"{queue[0][0].kind} {queue[0][0].index}")
        for channel, key, with_input, cmd in pending:
            _key, sent_clock, sent_with_input = self.channels[channel].popleft()
            if sent_clock != clock:
                self.fail(rank, clock, cmd, f"message sent at clock {sent_clock} received at {clock}")
            if sent_with_input != with_input:
                self.fail(rank, clock, cmd, "sender and receiver disagree on the payload")
            self.deliver(channel, key, clock)
        for channel, key in self.handed.pop(rank, []):
            self.deliver(channel, key, clock)
        self.queued_recvs[rank] = []
        self.committing.discard(rank)
        return True

    def deliver(self, channel, key, clock) -> None:
        """A message arrives at the commit of ``clock``: tied weights are applied, the rest waits in the inbox."""
        tie = channels.tie_of(channel.kind)
        if tie is not None and tie[0] == channels.TIED_WEIGHT:
            self.report.tied_weights.setdefault((channel.dst, tie[1]), []).append(key.index)
        else:
            self.inbox[key] = clock

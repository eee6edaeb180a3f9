"""Per-clock point-to-point traffic between pipeline ranks, safe under NCCL's rules (docs/design/nccl.md).

The rules, from NCCL's and torch's documentation and the reports that hit them:

- a send or receive blocks its communicator's stream until the peer's matching call is launched, and a
  rank's operations run in issue order, so a receive waiting for a peer blocks every later send of that
  rank (pytorch/pytorch#109401: interleaved ``isend``/``irecv`` hang);
- operations that must progress together are fused in one group, ``batch_isend_irecv`` (NVIDIA/nccl#479);
- tags are ignored: the n-th send from a to b pairs with the n-th receive at b from a;
- with NCCL, the first call on a process group must involve all of its ranks (``batch_isend_irecv``);
- two communicators (two streams) are not guaranteed to progress independently (NVIDIA/nccl#783), so
  splitting the directions over two communicators would not be a way out.

The design: every message of a clock belongs to a *phase* named by its channel kind (activations, then
gradients, then tied weights and gradients). Each rank issues, per clock and phase, **one batch** holding
all its sends and receives of that phase, in the order ``PostP2P`` instructions of the schedule give
(after the last forward, after the last backward, at the commit), and waits for all of them at the clock's
``CommitP2P``. Why no rank can hang: a message is sent and received in the same (clock, phase) by both
ends, every rank issues its batches in increasing (clock, phase) order, and a batch is one fused launch:
by induction over (clock, phase), every batch of a phase gets issued (a rank issues it after computing the
clock, which only needs earlier phases' data) and then completes, whatever the order in which its peers
issue theirs. No receive is ever queued ahead of a send it must progress with, nothing relies on tags
(ops of a batch are sorted by channel on both ends, so each pair lists them in the same order), and the
directions share one communicator. The activations' batch is issued right after the forward, so their
transfer overlaps the backward; the gradients' batch overlaps the optimizer step and the tied weights.
A channel's first message carries its layout (a header batch of the same phase, waited for: the receiver
allocates from it). A world barrier when the transport starts is the first call on the group the batches
use, so it involves every rank. Collectives (data-parallel reductions, the loss broadcast, checkpoint
barriers, the gradient-quality gather) also go through here, so one recorder sees all communication:
``PETRA_DS_COMM_TRACE=<dir>`` writes each rank's issue order to ``<dir>/trace-rank<R>.json`` for
:mod:`petra_ds.verify.nccl_replay`, which replays it under the rules above.

What a rank received waits in its :class:`Inbox` for the instruction that reads it. One process hosting many
stages (the paper's single-GPU setting) holds there every stage's forward and backward messages between two
clocks: on an H100 hosting RevNet18's ten stages, 792 MiB of the 1,129 MiB PETRA kept between calls, more than its
input FIFOs. With ``"petra": {"message_offload": "cpu"}`` a message for a stage of the same rank is handed over as
its host copy, made as it is sent (``runtime/fifo.py``'s copies: a side stream each way, pinned memory, events),
and its device copy is dropped; it starts back to the device when the compute instruction before its reader starts
(:meth:`Inbox.prefetch_next`), and the read waits for that copy's event on the compute stream, never on the host.
Messages from other ranks stay in the buffers their exchange received them into.
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping
from contextlib import contextmanager
from typing import Any, Callable, Container, Iterator, Sequence

import torch
from deepspeed import comm as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..schedule.channels import ACT, EVAL, GRAD, Channel, Key, channel_name
from ..util.files import replace_atomically
from ..util.nested import tensors_in
from . import messages
from .fifo import Copies, Entry

#: the environment variable naming the directory the communication traces go to (a diagnostic for short
#: runs: each rank rewrites its whole trace at the end of every window)
TRACE_ENV = "PETRA_DS_COMM_TRACE"


class PeerLostError(RuntimeError):
    """A collective or message exchange failed: another rank died or stopped answering."""


def group_ranks(group: Any) -> list[int]:
    """The global ranks of a process group (``None``: the world)."""
    if group is None:
        return list(range(dist.get_world_size()))
    return sorted(torch.distributed.get_process_group_ranks(group))


class Recorder:
    """Every communication call of this rank in issue order, in :mod:`petra_ds.verify.nccl_replay`'s format."""

    def __init__(self, directory: str, rank: int) -> None:
        self.path = os.path.join(directory, f"trace-rank{rank}.json")
        self.events: list[dict[str, Any]] = []
        os.makedirs(directory, exist_ok=True)

    def add(self, event: dict[str, Any]) -> int:
        self.events.append(event)
        return len(self.events) - 1

    def wait(self, ref: int) -> None:
        self.events.append({"op": "wait", "ref": ref})

    def save(self) -> None:
        """Rewrite the file whole (written aside, then renamed: a reader never sees half of it)."""
        replace_atomically(self.path, lambda f: json.dump(self.events, f))


class Transport:
    """The point-to-point traffic of one rank's PETRA stages, and its collectives.

    Per clock: :meth:`send` and :meth:`recv` queue messages (a message between two stages of this rank is
    handed over in memory), :meth:`post` issues the queued ones as one batch, :meth:`commit` issues what is
    left and waits for everything, returning the received messages by key. Stage 0's micro-batches come
    from the user's data iterator through :meth:`load`.
    """

    def __init__(self, *, rank: int, device: torch.device, local_stages: Container[int],
                 stage_rank: Callable[[int], int], clock: Callable[[], int], trace_dir: str | None = None) -> None:
        self.rank = rank
        self.device = device
        self.local_stages = local_stages
        self.stage_rank = stage_rank
        self._clock = clock
        #: the negotiated layout of every channel this rank sent or received on
        self.layouts: dict[Channel, messages.Layout] = {}
        #: the layout of training's micro-batches, fixed by the first one stage 0 loads
        self.data_layout: messages.Layout | None = None
        self._sends: list[tuple[Channel, tuple]] = []
        self._recvs: list[tuple[Channel, Any]] = []
        self._local: dict[Any, tuple] = {}
        self._posted: list[tuple[list[Any], int | None]] = []  # (works, trace event) per batch
        self._buffers: list[tuple[Any, Channel, messages.Layout, list[Tensor]]] = []
        self._keep_alive: list[Tensor] = []
        trace_dir = trace_dir if trace_dir is not None else os.environ.get(TRACE_ENV)
        self.recorder = Recorder(trace_dir, rank) if trace_dir else None
        self.barrier("transport start: the first call on the world group involves every rank")

    # --- errors ---

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Communication failures name this rank, its stages, the clock and what to do, with the
        backend's own error chained (gloo names only an address)."""
        try:
            yield
        except PeerLostError:
            raise
        except RuntimeError as error:
            raise PeerLostError(
                f"rank {self.rank} (PETRA stages {list(self.local_stages)}) lost a peer during {what} "
                f"at clock {self._clock()}: another rank died or stopped answering ({error}). Restart every "
                "rank from the last checkpoint (engine.load_checkpoint(dir), or --resume in the examples)") from error

    # --- stage 0's data ---

    def load(self, data: Iterator | None, batch_fn: Callable | None, micro_batch: int, ran_out: str, *,
             fixed_layout: bool = True) -> tuple[Any, Any]:
        """Micro-batch ``micro_batch``, the next ``(inputs, labels)`` of ``data``, on this rank's device;
        ``ran_out`` says what to do when the iterator is exhausted. With ``fixed_layout`` (training) the first
        one fixes the layout of every later one: PETRA exchanges shapes once."""
        batch = messages.read_micro_batch(data, batch_fn, self.device, ran_out)
        if fixed_layout:
            self.data_layout = messages.check_layout(self.data_layout, batch, micro_batch)
        return batch

    # --- one clock ---

    @property
    def in_flight(self) -> bool:
        """Messages queued, posted or handed over and not yet committed."""
        return bool(self._sends or self._recvs or self._local or self._posted)

    def send(self, channel: Channel, key: Any, fields: tuple) -> None:
        """Queue ``fields`` for the stage ``channel[2]``; ``key`` names it in the receiver's inbox."""
        if channel[2] in self.local_stages:
            self._local[key] = fields
        else:
            self._sends.append((channel, fields))

    def recv(self, channel: Channel, key: Any) -> None:
        """Queue the receive of the message on ``channel``, from a stage of another rank (a stage of this rank hands
        its messages over at the commit: the schedule lists no receive for them)."""
        self._recvs.append((channel, key))

    def post(self, what: str, fresh_layouts: bool = False) -> None:
        """Issue everything queued as one batch (with a header batch first on new channels; on every
        channel with ``fresh_layouts``, for messages whose shapes may change from call to call)."""
        sends, recvs = self._sends, self._recvs
        self._sends, self._recvs = [], []
        if sends or recvs:
            works, event, buffers, keep = self._issue(sends, recvs, {} if fresh_layouts else self.layouts, what)
            self._posted.append((works, event))
            self._buffers.extend(buffers)
            self._keep_alive.extend(keep)

    def commit(self, what: str = "the clock's commit") -> dict[Any, tuple]:
        """Post what is still queued, wait for every batch of the clock; the messages received, by key."""
        self.post(what)
        self._wait(self._posted, self._buffers)
        received = dict(self._local)
        received.update(self._unflatten(self._buffers))
        self._local, self._posted, self._buffers, self._keep_alive = {}, [], [], []
        return received

    def exchange(self, sends: Sequence[tuple[Channel, tuple]], recvs: Sequence[tuple[Channel, Any]],
                 what: str) -> dict[Any, tuple]:
        """One blocking exchange beside the clock's traffic (evaluation, the gradient-quality probe), with
        a header on every message (its shapes may change from call to call). Every rank runs it at the same
        point of its issue order, so it pairs up like the clock's batches."""
        layouts: dict[Channel, messages.Layout] = {}
        works, event, buffers, _keep = self._issue(list(sends), list(recvs), layouts, what)
        self._wait([(works, event)], buffers)
        return self._unflatten(buffers)

    def _issue(self, sends: list, recvs: list, layouts: dict, what: str) -> tuple[list, int | None, list, list]:
        """One ``batch_isend_irecv`` of ``sends`` and ``recvs``, each side sorted by channel so that both ends
        of a pair list their messages in the same order (NCCL pairs by order, not by tag).
        Returns (works, trace event, receive buffers, send tensors to keep alive until the wait)."""
        sends = sorted(sends, key=lambda s: s[0])
        recvs = sorted(recvs, key=lambda r: r[0])
        self._negotiate(sends, recvs, layouts, what)
        ops, info, buffers, keep = [], [], [], []
        for channel, fields in sends:
            peer = self.stage_rank(channel[2])
            for t in messages.flatten(fields):
                ops.append(dist.P2POp(dist.isend, t, peer))
                info.append(("send", peer, t, channel))
                keep.append(t)
        for channel, key in recvs:
            peer = self.stage_rank(channel[1])
            tensors = messages.allocate(layouts[channel], self.device)
            ops.extend(dist.P2POp(dist.irecv, t, peer) for t in tensors)
            info.extend(("recv", peer, t, channel) for t in tensors)
            buffers.append((key, channel, layouts[channel], tensors))
        event = self._record_batch(info, what)
        with self.guard(f"posting {what}"):
            works = dist.batch_isend_irecv(ops) if ops else []
        return works, event, buffers, keep

    def _wait(self, posted: list[tuple[list[Any], int | None]], buffers: list) -> None:
        peers = sorted({self.stage_rank(c[1]) for _, c, _, _ in buffers})
        with self.guard(f"the message exchange with ranks {peers}"):
            for works, event in posted:
                for work in works:
                    work.wait()
                if event is not None:
                    self.recorder.wait(event)

    @staticmethod
    def _unflatten(buffers: list) -> dict[Any, tuple]:
        return {key: messages.unflatten(tensors, layout) for key, _channel, layout, tensors in buffers}

    def _negotiate(self, sends: list, recvs: list, layouts: dict, what: str) -> None:
        """Check each send against its channel's layout; a channel's first message sends the layout first,
        in a batch of its own that both ends wait for (the receiver allocates from it)."""
        ops, info, headers = [], [], []
        for channel, fields in sends:
            layout = messages.layout_of(fields)
            known = layouts.get(channel)
            if known is None:
                layouts[channel] = layout
                header = messages.encode(layout).to(self.device)
                peer = self.stage_rank(channel[2])
                ops.append(dist.P2POp(dist.isend, header, peer))
                info.append(("send", peer, header, ("header:" + channel[0],) + channel[1:]))
            elif layout != known:
                raise messages.MessageLayoutError(
                    f"stage {channel[1]} sends {messages.describe(layout)} to stage {channel[2]}, but the "
                    f"layout negotiated on the first message was {messages.describe(known)}; "
                    "PETRA exchanges shapes once: keep micro-batch shapes fixed")
        for channel, _key in recvs:
            if channel not in layouts:
                header = torch.zeros(messages.HEADER_LEN, dtype=torch.int64, device=self.device)
                peer = self.stage_rank(channel[1])
                ops.append(dist.P2POp(dist.irecv, header, peer))
                info.append(("recv", peer, header, ("header:" + channel[0],) + channel[1:]))
                headers.append((channel, header))
        if not ops:
            return
        event = self._record_batch(info, f"layout headers of {what}")
        with self.guard(f"the layout exchange of {what}"):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if event is not None:
            self.recorder.wait(event)
        for channel, header in headers:
            layouts[channel] = messages.decode(header.cpu())

    # --- collectives ---

    def all_reduce(self, tensor: Tensor, group: Any, what: str) -> None:
        self._record_collective("all_reduce", group, what, numel=tensor.numel())
        with self.guard(what):
            dist.all_reduce(tensor, group=group)

    def average_over_replicas(self, tensors: list[Tensor], group: Any, what: str) -> None:
        """One all-reduce inside the stage's data-parallel ``group``: the accumulated gradients, and the
        batch-norm running statistics, so every replica evaluates with the same ones (each replica's
        reconstructions updated them from its own micro-batches)."""
        floats = [t for t in tensors if t.is_floating_point()]
        if not floats:
            return
        flat = _flatten_dense_tensors(floats)
        self.all_reduce(flat, group, what)
        flat /= torch.distributed.get_world_size(group)
        for t, synced in zip(floats, _unflatten_dense_tensors(flat, floats)):
            t.copy_(synced)

    def broadcast(self, tensor: Tensor, src: int, group: Any, what: str) -> None:
        self._record_collective("broadcast", group, what, numel=tensor.numel(), root=src)
        with self.guard(what):
            dist.broadcast(tensor, src=src, group=group)

    def barrier(self, what: str) -> None:
        self._record_collective("barrier", None, what)
        with self.guard(what):
            dist.barrier()

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order (a collective over the world)."""
        self._record_collective("all_gather_object", None, what)
        gathered: list[Any] = [None] * dist.get_world_size()
        with self.guard(what):
            dist.all_gather_object(gathered, obj)
        return gathered

    # --- the trace ---

    def save_trace(self) -> None:
        """Write this rank's communication so far (only when tracing is on)."""
        if self.recorder is not None:
            self.recorder.save()

    def _record_batch(self, info: list[tuple[str, int, Tensor, Channel]], what: str) -> int | None:
        if self.recorder is None:
            return None
        return self.recorder.add({
            "op": "batch", "group": group_ranks(None), "clock": self._clock(),
            "stages": list(self.local_stages), "what": what,
            "ops": [{"kind": kind, "peer": peer, "numel": t.numel(), "dtype": str(t.dtype).replace("torch.", ""),
                     "channel": channel_name(channel)} for kind, peer, t, channel in info]})

    def _record_collective(self, kind: str, group: Any, what: str, numel: int | None = None,
                           root: int | None = None) -> None:
        if self.recorder is None:
            return
        ref = self.recorder.add({"op": "collective", "kind": kind, "group": group_ranks(group), "root": root,
                                 "numel": numel, "clock": self._clock(), "stages": list(self.local_stages),
                                 "what": what})
        self.recorder.wait(ref)  # every collective here is synchronous


#: the values ``"petra.message_offload"`` takes: "none" keeps messages on the device, "cpu" parks the messages
#: between stages of one rank in host memory
MESSAGE_OFFLOADS = ("none", "cpu")
#: the kinds of message a compute instruction reads from the inbox, which ``message_offload`` parks (tied weights
#: are applied as a commit receives them, and stage 0's data is read in the clock that loads it)
PARKED_KINDS = (ACT, GRAD, EVAL)


def _next_reads(cmds: Sequence[Any]) -> list[Key | None]:
    """Per instruction of a clock, the message key of the next instruction after it that reads one (None: none
    does)."""
    found: list[Key | None] = [None] * len(cmds)
    key = None
    for i in range(len(cmds) - 1, -1, -1):
        found[i] = key
        consumes = getattr(cmds[i], "consumes", None)
        if consumes is not None:
            key = consumes
    return found


class Inbox(MutableMapping):
    """What this rank's stages received (and stage 0 loaded) for the instructions of the next clock, by
    :class:`Key`. A parked message is a FIFO :class:`Entry` (``runtime/fifo.py``) of its own. :meth:`pop` hands an
    instruction its message on the device; indexing and :meth:`items` give each message where it is (a parked one's
    host copy, written: what a checkpoint saves)."""

    def __init__(self, copies: Copies | None = None, before_park: Callable[[], None] | None = None) -> None:
        """``copies``: how parked messages move (None: nothing is parked); ``before_park``: called before a message
        leaves the device (the NaN watch's flush, which reduces what it holds of it while it is there)."""
        self.copies, self.before_park = copies, before_park
        self._items: dict[Key, Any] = {}
        #: the clock :meth:`prefetch_next` was last asked about, and per instruction the key the next reader reads
        self._clock: Sequence[Any] | None = None
        self._next_read: list[Key | None] = []

    def park(self, key: Key, fields: tuple, receiver_here: bool = True) -> Any:
        """What to hand over as message ``key``: ``fields`` itself, or, with the offload, for a message an
        instruction of a stage of this rank reads, an :class:`Entry` whose host copy has started."""
        if self.copies is None or not receiver_here or key.kind not in PARKED_KINDS:
            return fields
        flat = tensors_in(fields)
        if not flat:
            return fields
        if self.before_park is not None:
            self.before_park()
        return Entry.offloaded(key.index, fields, self.copies, flat)

    def prefetch(self, key: Key) -> None:
        """Start a parked message back to its device (nothing for one already there or on its way)."""
        value = self._items.get(key)
        if isinstance(value, Entry):
            value.fetch(self.copies)

    def prefetch_next(self, cmds: Sequence[Any], i: int) -> None:
        """Before instruction ``i`` of a clock runs: start back the message of the next instruction that reads one
        (found for every ``i`` in one pass when a clock's first instruction asks)."""
        if cmds is not self._clock:
            self._clock, self._next_read = cmds, _next_reads(cmds)
        key = self._next_read[i]
        if key is not None:
            self.prefetch(key)

    def pop(self, key: Key, *default: Any) -> Any:
        """Remove the message ``key`` and return it on its device (after its copy back, on the compute stream)."""
        value = self._items.pop(key, *default)
        if not isinstance(value, Entry):
            return value
        value.fetch(self.copies)
        self.copies.wait(value.ready)
        return value.value

    def on_device(self) -> Iterator[tuple[Key, Any]]:
        """(key, message) of what is on the device now: the messages never parked, and parked ones started back."""
        for key, value in self._items.items():
            if not isinstance(value, Entry):
                yield key, value
            elif value.value is not None:
                yield key, value.value

    def on_host(self) -> Iterator[tuple[Key, tuple]]:
        """(key, host copy) of every parked message still in host memory."""
        for key, value in self._items.items():
            if isinstance(value, Entry) and value.host is not None:
                yield key, value.host

    def __getitem__(self, key: Key) -> Any:
        value = self._items[key]
        return value.settled(self.copies) if isinstance(value, Entry) else value

    def __setitem__(self, key: Key, value: Any) -> None:
        self._items[key] = value

    def __delitem__(self, key: Key) -> None:
        del self._items[key]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def update(self, other: dict[Key, Any]) -> None:
        """Add ``other``'s messages as they are (parked ones stay parked)."""
        self._items.update(other)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

"""The NCCL-rules replay on synthetic traces: each test has a twin that differs only in what the rule is
about (grouping, order, group, a wait), so a replay that ignored the rule would fail one of the two."""

import json

import pytest

from legacy_posting import legacy_trace
from petra_ds.verify.nccl_replay import (NcclHang, NcclPairingError, NcclReplayError, NcclRuleError, load_traces,
                                         replay_nccl)


def send(peer, numel, channel):
    return {"kind": "send", "peer": peer, "numel": numel, "dtype": "float32", "channel": channel}


def recv(peer, numel, channel):
    return {"kind": "recv", "peer": peer, "numel": numel, "dtype": "float32", "channel": channel}


def batch(group, *ops, clock=None, what="", stages=()):
    return {"op": "batch", "group": list(group), "ops": list(ops), "clock": clock, "stages": list(stages),
            "what": what}


def collective(kind, group, root=None, numel=None, clock=None, what=""):
    return {"op": "collective", "kind": kind, "group": list(group), "root": root, "numel": numel,
            "clock": clock, "stages": [], "what": what}


def wait(ref):
    return {"op": "wait", "ref": ref}


def synchronous(events, *more):
    """Append each batch or collective followed by a wait on it."""
    for event in more:
        events += [event, wait(len(events))]
    return events


def test_the_error_classes_are_assertions():
    for error in (NcclHang, NcclPairingError, NcclRuleError):
        assert issubclass(error, NcclReplayError) and issubclass(NcclReplayError, AssertionError)


# --- grouping: pytorch/pytorch#109401, NVIDIA/nccl#479 --------------------------------------------

def crossing_messages(grouped):
    """Rank 0 sends act:0->1 and receives grad:1->0 at clock 3; rank 1 the other ends. Ungrouped, each
    rank posts its receive before its send."""
    ends = {0: (recv(1, 4, "grad:1->0"), send(1, 4, "act:0->1")),
            1: (recv(0, 4, "act:0->1"), send(0, 4, "grad:1->0"))}
    traces = {}
    for rank, (r, s) in ends.items():
        if grouped:
            traces[rank] = synchronous([], batch([0, 1], r, s, clock=3, what="clock exchange"))
        else:
            traces[rank] = [batch([0, 1], r, clock=3, what="irecv"), batch([0, 1], s, clock=3, what="isend"),
                            wait(0), wait(1)]
    return traces


def test_ungrouped_receive_before_send_hangs():
    with pytest.raises(NcclHang) as caught:
        replay_nccl(crossing_messages(grouped=False))
    message = str(caught.value)
    for needle in ("rank 0", "rank 1", "clock 3", "act:0->1", "grad:1->0", "CPU blocked at event #2"):
        assert needle in message, (needle, message)


def test_the_same_messages_in_one_batch_per_rank_pass():
    report = replay_nccl(crossing_messages(grouped=True))
    assert report.batches == {0: 1, 1: 1} and report.transfers == 2
    assert report.p2p_ops == {0: 2, 1: 2} and report.max_queue_depth == {0: 1, 1: 1}


# --- pairing ignores tags -------------------------------------------------------------------------

@pytest.mark.parametrize("tag_reliant", [True, False])
def test_receives_pair_by_order_not_by_tag(tag_reliant):
    a, b = (4, "A"), (8, "B")
    order = (b, a) if tag_reliant else (a, b)
    traces = {0: [batch([0, 1], send(1, *a), clock=5), batch([0, 1], send(1, *b), clock=5), wait(0), wait(1)],
              1: [batch([0, 1], recv(0, *order[0]), clock=5), batch([0, 1], recv(0, *order[1]), clock=5),
                  wait(0), wait(1)]}
    if not tag_reliant:
        assert replay_nccl(traces).transfers == 2
        return
    with pytest.raises(NcclPairingError) as caught:
        replay_nccl(traces)
    message = str(caught.value)
    for needle in ("pairing mismatch", "rank 0", "rank 1", "clock 5", "send A", "recv B"):
        assert needle in message, (needle, message)


# --- collectives ----------------------------------------------------------------------------------

@pytest.mark.parametrize("second", ["broadcast", "all_reduce"])
def test_collectives_pair_by_position_and_must_agree(second):
    world = [0, 1]
    traces = {0: synchronous([], collective("all_reduce", world, numel=16, what="loss")),
              1: synchronous([], collective(second, world, numel=16, root=0 if second == "broadcast" else None,
                                            what="loss"))}
    if second == "all_reduce":
        assert replay_nccl(traces).collectives == {0: 1, 1: 1}
        return
    with pytest.raises(NcclPairingError, match="collective mismatch") as caught:
        replay_nccl(traces)
    assert "all_reduce" in str(caught.value) and "broadcast" in str(caught.value)


@pytest.mark.parametrize("reached", [False, True])
def test_a_subgroup_collective_only_some_ranks_reach_hangs(reached):
    traces = {0: synchronous([], collective("all_reduce", [0, 1], numel=8, clock=2, what="dp reduce")),
              1: synchronous([], collective("barrier", [1, 2], clock=2, what="checkpoint")),
              2: synchronous([], collective("barrier", [1, 2], clock=2, what="checkpoint"))}
    if reached:
        synchronous(traces[1], collective("all_reduce", [0, 1], numel=8, clock=2, what="dp reduce"))
        assert replay_nccl(traces).collectives == {0: 1, 1: 2, 2: 1}
        return
    with pytest.raises(NcclHang) as caught:
        replay_nccl(traces)
    message = str(caught.value)
    assert "rank 0" in message and "dp reduce" in message and "waits for rank 1: not issued yet" in message
    assert "rank 2" not in message  # ranks 1 and 2 finished


# --- torch's first-call rule for batch_isend_irecv ------------------------------------------------

@pytest.mark.parametrize("barrier_first", [False, True])
def test_first_call_on_a_p2p_group_must_involve_every_rank(barrier_first):
    world = [0, 1, 2]
    traces = {r: synchronous([], collective("barrier", world, what="start")) if barrier_first else [] for r in world}
    synchronous(traces[0], batch(world, send(1, 4, "act:0->1"), clock=0))
    synchronous(traces[1], batch(world, recv(0, 4, "act:0->1"), clock=0))
    if not barrier_first:
        synchronous(traces[2], collective("barrier", world, what="late"))
        for r in (0, 1):
            synchronous(traces[r], collective("barrier", world, what="late"))
    if barrier_first:
        assert replay_nccl(traces).transfers == 1
        return
    with pytest.raises(NcclRuleError) as caught:
        replay_nccl(traces)
    message = str(caught.value)
    assert "group [0, 1, 2]" in message and "rank 0's first call" in message and "rank 2's is" in message


# --- the CPU model: a wait stops issuing ----------------------------------------------------------

def ring_on_pair_groups(blocking):
    """Three ranks, three two-rank groups: each receives from its successor on one group and sends to its
    predecessor on another. Blocking: wait for the receive before issuing the send."""
    traces = {}
    for r in range(3):
        nxt, prev = (r + 1) % 3, (r - 1) % 3
        incoming = batch(sorted({r, nxt}), recv(nxt, 4, f"msg:{nxt}->{r}"), clock=1, what="receive")
        outgoing = batch(sorted({r, prev}), send(prev, 4, f"msg:{r}->{prev}"), clock=1, what="send")
        traces[r] = ([incoming, wait(0), outgoing, wait(2)] if blocking
                     else [incoming, outgoing, wait(0), wait(1)])
    return traces


@pytest.mark.parametrize("blocking", [False, True])
def test_a_blocking_wait_hangs_where_issuing_on_would_not(blocking):
    """Were communicators independent, only the CPU's wait would make this ring hang; the default model
    (one queue per rank) hangs it either way, which is the conservative answer."""
    traces = ring_on_pair_groups(blocking)
    if not blocking:
        assert replay_nccl(traces, independent_communicators=True).transfers == 3
    else:
        with pytest.raises(NcclHang, match="CPU blocked at event #1, a wait on event #0"):
            replay_nccl(traces, independent_communicators=True)
    with pytest.raises(NcclHang):
        replay_nccl(traces)


# --- no false positives ---------------------------------------------------------------------------

def neighbour_chain(ranks, clocks, ring=False):
    """Per clock, rank r exchanges with r-1 on group {r-1, r} (act in, grad out), then with r+1 on
    group {r, r+1} (act out, grad in), and waits for both. ``ring``: rank 0 exchanges with the last too."""
    world = list(range(ranks))
    traces = {r: synchronous([], collective("barrier", world, what="start")) for r in world}
    for clock in range(clocks):
        for r in world:
            posted = []
            for other, upstream in ((r - 1, True), (r + 1, False)):
                if not ring and not 0 <= other < ranks:
                    continue
                other %= ranks
                if upstream:
                    ops = (recv(other, 6, f"act:{other}->{r}"), send(other, 3, f"grad:{r}->{other}"))
                else:
                    ops = (send(other, 6, f"act:{r}->{other}"), recv(other, 3, f"grad:{other}->{r}"))
                posted.append(len(traces[r]))
                traces[r].append(batch(sorted({r, other}), *ops, clock=clock, stages=[r]))
            traces[r] += [wait(i) for i in posted]
    return traces


def test_chains_of_neighbour_groups_complete():
    report = replay_nccl(neighbour_chain(4, clocks=5))
    assert report.batches == {0: 5, 1: 10, 2: 10, 3: 5}
    assert report.transfers == 3 * 2 * 5 and report.collectives == {r: 1 for r in range(4)}
    assert report.max_queue_depth == {0: 1, 1: 2, 2: 2, 3: 1}


def test_closing_the_chain_into_a_ring_hangs():
    with pytest.raises(NcclHang, match="clock 0"):
        replay_nccl(neighbour_chain(4, clocks=2, ring=True))


def test_traces_load_from_the_recorder_files(tmp_path):
    for rank, events in crossing_messages(grouped=True).items():
        (tmp_path / f"trace-rank{rank}.json").write_text(json.dumps(events))
    (tmp_path / "notes.json").write_text("[]")
    traces = load_traces(tmp_path)
    assert sorted(traces) == [0, 1]
    assert replay_nccl(traces).transfers == 2


def test_a_wait_on_a_later_event_is_malformed():
    with pytest.raises(NcclRuleError, match="rank 0 event #0 .*a wait must refer to an earlier"):
        replay_nccl({0: [wait(1), collective("barrier", [0])]})


# --- the old engine posting: the negative control -------------------------------------------------

def test_the_old_engine_posting_hangs_once_gradients_flow_back():
    """J=6 on 2 ranks, k=2: clock 8 is the first where rank 0 sends activations while rank 1 sends
    gradients; each rank's receive, posted at the clock's start, blocks its send."""
    traces = legacy_trace(2, 3, 4, 2, reversible=True)
    with pytest.raises(NcclHang) as caught:
        replay_nccl(traces)
    message = str(caught.value)
    for needle in ("recv grad:3->2", "recv act:2->3", "clock 8", "rank 0", "rank 1"):
        assert needle in message, (needle, message)


@pytest.mark.parametrize("reversible", [True, False])
def test_one_batch_per_rank_and_clock_passes(reversible):
    traces = legacy_trace(2, 3, 4, 2, reversible=reversible, grouped=True)
    report = replay_nccl(traces)
    assert report.transfers == 2 * 8  # 8 micro-batches cross the boundary forward and back
    assert report.max_queue_depth == {0: 1, 1: 1}

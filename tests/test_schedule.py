"""The PETRA schedule, replayed for every rank by the pure simulator."""

import pytest
from hypothesis import given, settings, strategies as st
from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule

from petra_ds.verify.replay import ScheduleError, replay, streams_for
from petra_ds.schedule import (AccumulateAndStep, CommitP2P, DelayedBackward, ForwardPass, PetraSchedule,
                               ReverseReconstruct, SendActivation, Timeline, delay)


def mixed_reversibility(J):
    """Non-reversible stem and every third stage (downsampling blocks), reversible elsewhere."""
    return [j % 3 != 0 for j in range(J)]


def windows_for(J, plan):
    """(timeline after them, the windows) of plan: a list of (clocks, micro_batches) for train windows, or
    None for a drain."""
    timeline = Timeline(J)
    windows = []
    for item in plan:
        window = timeline.drain_window() if item is None else timeline.train_window(*item)
        timeline.advance(window)
        windows.append(window)
    return timeline, windows


def run_windows(J, S, k, plan, reversible=None):
    """plan: list of (clocks, micro_batches) for train windows, or None for a drain."""
    timeline, windows = windows_for(J, plan)
    reversible = mixed_reversibility(J) if reversible is None else reversible
    streams = streams_for(windows, pipeline_ranks=J // S, stages_per_rank=S,
                          gradient_accumulation_steps=k, reversible=reversible)
    report = replay(streams, petra_stages=J, stages_per_rank=S, gradient_accumulation_steps=k,
                    reversible=reversible)
    return timeline, streams, report


def training_plan(k):
    # three train_batch calls, the last one short, a drain, one more call and a final drain
    return [(k, k), (k, k), (k, max(k - 1, 0)), None, (k, k), None]


@pytest.mark.parametrize("S", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_replay_all_ranks(S, k):
    for J in range(S, 33, S):
        timeline, _streams, report = run_windows(J, S, k, training_plan(k))
        M = timeline.feed.total
        assert M == 4 * k - 1
        if k > 1:
            assert M % k != 0
        report.assert_drained()
        for j in range(J):
            fwd = sorted(m for (s, m) in report.forward_clock if s == j)
            bwd = sorted(m for (s, m) in report.backward_clock if s == j)
            assert len(fwd) == len(set(fwd)) == M and fwd == bwd, (J, j)
            for m in fwd:
                assert report.backward_clock[(j, m)] - report.forward_clock[(j, m)] == 2 * (J - 1 - j)
            assert len(report.steps[j]) == M // k, (J, j)


def test_fifo_holds_exactly_the_micro_batches_in_flight():
    J, k = 8, 2
    _t, _s, report = run_windows(J, 1, k, [(k, k)] * 10 + [None], reversible=[False] * J)
    for j in range(1, J - 1):
        assert report.max_fifo[j] == delay(j, J) + 1
    assert 0 not in report.max_fifo and J - 1 not in report.max_fifo


def test_reversible_stages_hold_no_fifo_and_reconstruct():
    J = 6
    _t, streams, report = run_windows(J, 1, 1, [(5, 5), None], reversible=[True] * J)
    assert all(depth == 0 for depth in report.max_fifo.values())
    recon = [c for clocks in streams.values() for cmds in clocks for c in cmds if isinstance(c, ReverseReconstruct)]
    assert sorted({c.stage for c in recon}) == list(range(1, J - 1))


def test_stage_sequence_does_not_depend_on_placement():
    """1 rank x 6 stages, 2 x 3, 3 x 2 and 6 x 1 run the same compute per stage at the same clocks."""
    J, k = 6, 2
    plan = [(k, k)] * 4 + [None]

    def per_stage(S):
        _t, streams, _r = run_windows(J, S, k, plan)
        out = {}
        for clocks in streams.values():
            for t, cmds in enumerate(clocks):
                for c in cmds:
                    if isinstance(c, (ForwardPass, ReverseReconstruct, DelayedBackward, AccumulateAndStep)):
                        out.setdefault(c.stage, []).append((t, repr(c)))
        return out

    reference = per_stage(1)
    for S in (2, 3, 6):
        assert per_stage(S) == reference


def test_schedule_is_a_deepspeed_schedule():
    timeline = Timeline(4)
    window = timeline.train_window(3)
    schedule = PetraSchedule.for_window(window, 2, 1, stages_per_rank=2)
    assert isinstance(schedule, PipeSchedule)
    steps = list(schedule)
    assert len(steps) == 3
    assert all(isinstance(c, PipeInstruction) for cmds in steps for c in cmds)
    assert list(schedule.local_stages) == [2, 3]


def test_each_instruction_holds_what_deepspeed_s_pipe_instruction_would_set():
    """PETRA's instructions set their fields in one update; DeepSpeed's own constructor, run on the same keywords,
    sets exactly the same attributes."""
    timeline = Timeline(4)
    schedule = PetraSchedule.for_window(timeline.train_window(6), 1, 0, stages_per_rank=4)
    built = [c for cmds in schedule for c in cmds]
    assert len({type(c) for c in built}) >= 8
    for c in built:
        reference = object.__new__(type(c))
        PipeInstruction.__init__(reference, **c.kwargs)
        assert vars(reference) == vars(c), c


def tamper(streams, rank, predicate, action):
    for cmds in streams[rank]:
        for i, c in enumerate(cmds):
            if predicate(c):
                action(cmds, i)
                return
    raise AssertionError("nothing to tamper with")


def replay_tampered(J, k, predicate, action, rank):
    _, windows = windows_for(J, [(k, k)] * 3 + [None])
    rev = mixed_reversibility(J)
    streams = streams_for(windows, pipeline_ranks=J, stages_per_rank=1, gradient_accumulation_steps=k, reversible=rev)
    tamper(streams, rank, predicate, action)
    report = replay(streams, petra_stages=J, stages_per_rank=1, gradient_accumulation_steps=k, reversible=rev)
    report.assert_drained()


def test_replay_detects_a_missing_send_as_deadlock():
    with pytest.raises(ScheduleError, match="deadlock|never sent"):
        replay_tampered(4, 2, lambda c: isinstance(c, SendActivation), lambda cmds, i: cmds.pop(i), rank=1)


def test_replay_detects_an_uncommitted_exchange():
    with pytest.raises(ScheduleError, match="uncommitted"):
        replay_tampered(4, 2, lambda c: isinstance(c, CommitP2P), lambda cmds, i: cmds.pop(i), rank=2)


def test_replay_detects_a_step_before_the_compute_of_its_clock():
    def move_step_first(cmds, i):
        cmds.insert(0, cmds.pop(i))

    with pytest.raises(ScheduleError, match="after the stage's optimizer step|backwards"):
        replay_tampered(4, 1, lambda c: isinstance(c, AccumulateAndStep), move_step_first, rank=3)


def test_replay_detects_a_missing_backward():
    with pytest.raises(ScheduleError):
        replay_tampered(3, 1, lambda c: isinstance(c, DelayedBackward), lambda cmds, i: cmds.pop(i), rank=0)


window_plans = st.lists(
    st.one_of(st.none(), st.tuples(st.integers(1, 5), st.integers(0, 5)).map(lambda t: (t[0], min(t))),),
    min_size=1, max_size=6,
).map(lambda plan: plan + [None])


@settings(max_examples=60, deadline=None)
@given(J=st.integers(1, 9), S=st.sampled_from([1, 3]), k=st.integers(1, 5), plan=window_plans,
       reversible_bits=st.integers(0, 2**9 - 1))
def test_any_window_sequence_replays_and_drains(J, S, k, plan, reversible_bits):
    if J % S:
        J = S * max(1, J // S)
    reversible = [bool(reversible_bits >> j & 1) for j in range(J)]
    timeline, _s, report = run_windows(J, S, k, plan, reversible)
    report.assert_drained()
    M = timeline.feed.total
    for j in range(J):
        assert report.backwards(j) == M and len(report.steps[j]) == M // k


@pytest.mark.parametrize("S", [1, 2])
@pytest.mark.parametrize("k", [1, 3])
def test_replay_with_tied_weights(S, k):
    """An embedding tied to the head (stage 0 <-> J-1) and a weight shared by stage 1 with two later
    stages: no deadlock, each owner step has every reader's gradient before it, and every reader
    receives the weights of every owner step."""
    for J in range(2 * S, 17, S):
        ties = [("embedding", 0, (J - 1,))] + ([("shared", 1, (2, J - 1))] if J >= 4 else [])
        timeline = Timeline(J)
        windows = []
        for item in training_plan(k):
            window = timeline.drain_window() if item is None else timeline.train_window(*item)
            timeline.advance(window)
            windows.append(window)
        streams = streams_for(windows, pipeline_ranks=J // S, stages_per_rank=S, gradient_accumulation_steps=k,
                              reversible=mixed_reversibility(J), ties=ties)
        report = replay(streams, petra_stages=J, stages_per_rank=S, gradient_accumulation_steps=k,
                        reversible=mixed_reversibility(J), ties=ties)
        report.assert_drained()
        for key, owner, readers in ties:
            steps = list(range(1, len(report.steps[owner]) + 1))
            assert steps, (J, key)
            for reader in readers:
                assert report.tied_weights[(reader, key)] == steps, (J, key, reader)

        # dropping one weight message is caught
        rank = (J - 1) // S
        broken = {r: [[c for c in cmds if not (r == rank and type(c).__name__ == "RecvTiedWeight")]
                      for cmds in clocks] for r, clocks in streams.items()}
        with pytest.raises(ScheduleError):
            replay(broken, petra_stages=J, stages_per_rank=S, gradient_accumulation_steps=k,
                   reversible=mixed_reversibility(J), ties=ties).assert_drained()


def test_replay_detects_a_receive_of_a_message_handed_over_on_its_own_rank():
    """Stages 0 and 1 share rank 0: stage 0's activation is handed over at the commit, and a receive for it (which
    a real rank would post to itself) is refused."""
    from petra_ds.schedule import RecvActivation

    J, S, k = 4, 2, 2
    _, windows = windows_for(J, [(k, k)] * 3 + [None])
    streams = streams_for(windows, pipeline_ranks=J // S, stages_per_rank=S, gradient_accumulation_steps=k,
                          reversible=[True] * J)
    tamper(streams, 0, lambda c: isinstance(c, SendActivation) and c.stage == 0,
           lambda cmds, i: cmds.insert(i + 1, RecvActivation(1, cmds[i].micro_batch + 1)))
    with pytest.raises(ScheduleError, match="a receive from a stage of this rank"):
        replay(streams, petra_stages=J, stages_per_rank=S, gradient_accumulation_steps=k, reversible=[True] * J)


def test_replay_detects_compute_out_of_its_clock_phase_order():
    """Stage 0's backward moved to the front of its rank's clock: stage 0 on its own is fine (its gradient
    came at the previous clock, its raw micro-batch is kept), the rank's clock is not (the load and the
    forwards would run after a backward, whose parameters may change them)."""
    def backward_first(cmds, i):
        cmds.insert(0, cmds.pop(i))

    with pytest.raises(ScheduleError, match="after the backward phase of its clock"):
        replay_tampered_two_stages(backward_first)


def replay_tampered_two_stages(action):
    J, S, k = 4, 2, 2
    _, windows = windows_for(J, [(k, k)] * 3 + [None])
    streams = streams_for(windows, pipeline_ranks=J // S, stages_per_rank=S, gradient_accumulation_steps=k,
                          reversible=[True] * J)
    clock = next(c for c in streams[0] if any(isinstance(x, DelayedBackward) and x.stage == 0 for x in c)
                 and any(isinstance(x, ForwardPass) for x in c))
    action(clock, next(i for i, x in enumerate(clock) if isinstance(x, DelayedBackward) and x.stage == 0))
    replay(streams, petra_stages=J, stages_per_rank=S, gradient_accumulation_steps=k, reversible=[True] * J)


def test_every_message_is_derived_from_what_the_compute_consumes_and_produces():
    """A rank's sends follow the compute that produced their key, in the same clock; its receives are the
    keys its compute consumes at the next clock from stages of other ranks, and a key one of its own stages
    produced is sent and handed over, never received; no compute consumes or produces anything else by a message
    (stage 0 takes its loaded micro-batch, never a message)."""
    from petra_ds.schedule import EvalSchedule, LoadMicroBatch, channels

    J, S, k = 6, 2, 2
    _t, windows = windows_for(J, [(k, k)] * 4 + [None])
    rev = mixed_reversibility(J)
    streams = streams_for(windows, pipeline_ranks=J // S, stages_per_rank=S, gradient_accumulation_steps=k,
                          reversible=rev)
    evals = {r: list(EvalSchedule(3, J // S, r, stages_per_rank=S)) for r in range(J // S)}
    for all_clocks in (streams, evals):
        for rank, clocks in all_clocks.items():
            for t, cmds in enumerate(clocks):
                produced = {c.produces for c in cmds if getattr(c, "produces", None) is not None}
                following = clocks[t + 1] if t + 1 < len(clocks) else []
                consumed_next = {c.consumes for c in following if getattr(c, "consumes", None) is not None}
                sent = {c.key() for c in cmds if c.sends is True and c.channel().kind in
                        (channels.ACT, channels.GRAD, channels.EVAL)}
                received = {c.key() for c in cmds if c.sends is False and c.channel().kind in
                            (channels.ACT, channels.GRAD, channels.EVAL)}
                assert sent == {key for key in produced if key.kind != channels.DATA}, (rank, t)
                messages = {key for key in consumed_next if key.kind != channels.DATA}
                # the producer: the stage before for an activation, the stage after for a gradient
                mine = {key for key in messages if (key.stage + (1 if key.kind == channels.GRAD else -1)) // S == rank}
                assert received == messages - mine and mine <= sent, (rank, t)
                loads = [c for c in cmds if isinstance(c, LoadMicroBatch)]
                assert all(c.produces == channels.data_key(c.micro_batch) for c in loads)
    report = replay(streams, petra_stages=J, stages_per_rank=S, gradient_accumulation_steps=k, reversible=rev)
    report.assert_drained()


def test_replay_detects_a_compute_that_consumes_the_wrong_message():
    """The replay derives what a compute must consume again: a backward of a reconstructing stage that also
    claims the gradient message (its reconstruction took it) is named."""
    def claim_the_gradient(cmds, i):
        c = cmds[i]
        cmds[i] = DelayedBackward(c.stage, c.micro_batch, consumes=(c.stage + 1, "grad", c.micro_batch),
                                  produces=c.produces)

    with pytest.raises(ScheduleError, match="consumes"):
        replay_tampered(6, 1, lambda c: isinstance(c, DelayedBackward) and c.stage == 1 and c.consumes is None,
                        claim_the_gradient, rank=1)

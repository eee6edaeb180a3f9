"""PETRA's schedule over random layouts, checked against the clock equations (docs/design/clock.md).

tests/test_schedule.py replays fixed layouts and checks, over random window sequences, that the
pipeline drains with the right number of backwards and steps. Here every random configuration
(J = ranks x stages_per_rank, k, train_batch calls that feed all, some or none of their k clocks,
drains, reversible stages, input_buffer "all", "non_reversible" or "first_N", tied weights) is replayed through
``petra_ds.verify.replay`` and its report is compared with what the equations say, computed independently
of ``PetraSchedule``: which micro-batches exist, at which clock each forward, backward, step and
message happens.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings, strategies as st

from petra_ds.runtime.config import INPUT_BUFFERS
from petra_ds.verify.replay import replay, streams_for
from petra_ds.schedule import (ClockTemplates, PetraSchedule, RecvActivation, RecvGrad, RecvTiedGrad, RecvTiedWeight,
                               ReverseReconstruct, SendActivation, SendGrad, SendTiedGrad, SendTiedWeight, Timeline,
                               Window, backward_micro_batch, delay, forward_micro_batch)

DRAIN = None


@st.composite
def ties_for(draw, J: int) -> list[tuple[str, int, tuple[int, ...]]]:
    """Up to two tied weights, each owned by its first stage and read by some later ones."""
    ties = []
    for i in range(draw(st.integers(0, 2 if J > 1 else 0))):
        owner = draw(st.integers(0, J - 2))
        readers = draw(st.lists(st.integers(owner + 1, J - 1), min_size=1, max_size=3, unique=True))
        ties.append((f"tie{i}", owner, tuple(sorted(readers))))
    return ties


@st.composite
def runs(draw) -> dict:
    """A layout and a sequence of train_batch calls (micro-batches fed in the call's k clocks) and
    drains, ending with a drain as training does."""
    ranks, S = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    J, k = ranks * S, draw(st.integers(1, 6))
    plan = draw(st.lists(st.one_of(st.integers(0, k), st.just(DRAIN)), min_size=1, max_size=6))
    return {
        "ranks": ranks, "S": S, "J": J, "k": k, "plan": plan + [DRAIN],
        "reversible": draw(st.lists(st.booleans(), min_size=J, max_size=J)),
        "input_buffer": draw(st.sampled_from(INPUT_BUFFERS + ("first_1", "first_2"))),
        "ties": draw(ties_for(J)),
    }


def windows_of(run: dict) -> list[Window]:
    timeline = Timeline(run["J"])
    windows = []
    for item in run["plan"]:
        window = timeline.drain_window() if item is DRAIN else timeline.train_window(run["k"], item)
        timeline.advance(window)
        windows.append(window)
    return windows


def expected_feed(run: dict) -> list[int]:
    """The micro-batches fed, from the plan alone: one per clock from the start of a train_batch call,
    indexed by their entry clock; a drain runs until the last one fed had its backward at stage 0."""
    J, k = run["J"], run["k"]
    clock, fed = 0, []
    for item in run["plan"]:
        if item is DRAIN:
            clock = max(clock, fed[-1] + 2 * (J - 1) + 1) if fed else clock
        else:
            fed += range(clock, clock + item)
            clock += k
    return fed


def replayed(run: dict):
    windows = windows_of(run)
    reconstructs = [r and run["input_buffer"] != "all" for r in run["reversible"]]
    common = dict(stages_per_rank=run["S"], gradient_accumulation_steps=run["k"], reversible=reconstructs,
                  ties=run["ties"])
    streams = streams_for(windows, pipeline_ranks=run["ranks"], **common)
    report = replay(streams, petra_stages=run["J"], **common)
    return windows, streams, report, reconstructs


def instructions(streams: dict) -> list[tuple[int, object]]:
    """(clock, instruction) over every rank's stream."""
    return [(clock, cmd) for clocks in streams.values() for clock, cmds in enumerate(clocks) for cmd in cmds]


@settings(max_examples=150, deadline=None)
@given(run=runs())
def test_every_micro_batch_fed_runs_where_the_clock_equations_say(run):
    """No deadlock, nothing left after the drain; one forward and one backward per fed micro-batch and
    stage, at m + j and m + 2(J-1) - j; a step after every k-th backward of a stage; a drain that stops
    at the last backward."""
    J, k = run["J"], run["k"]
    windows, _streams, report, _rec = replayed(run)
    report.assert_drained()
    fed = expected_feed(run)
    every = {(j, m) for j in range(J) for m in fed}
    assert set(report.forward_clock) == every and set(report.backward_clock) == every
    for (j, m), clock in report.forward_clock.items():
        assert forward_micro_batch(clock, j) == m and clock == m + j
    for (j, m), clock in report.backward_clock.items():
        assert backward_micro_batch(clock, j, J) == m and clock == m + 2 * (J - 1) - j
        assert clock - report.forward_clock[(j, m)] == delay(j, J)
    for j in range(J):
        assert report.steps[j] == [report.backward_clock[(j, fed[i * k - 1])] for i in range(1, len(fed) // k + 1)]
    for window, item in zip(windows, run["plan"]):
        if item is DRAIN and window.clocks:
            assert report.backward_clock[(0, window.feed.last)] == window.start_clock + window.clocks - 1


@settings(max_examples=150, deadline=None)
@given(run=runs())
def test_every_message_travels_exactly_one_clock(run):
    """Each send has its receive in the same clock's exchange, and the receiver uses the message in the
    next clock: x_j of m at m + j feeds stage j+1's forward at m + j + 1; delta_j (with x~ when stage
    j-1 reconstructs) feeds stage j-1's backward one clock after stage j's. Tied gradients leave with
    the reader's step and reach the owner before its own step; the owner's weights leave with its step. A message
    between two stages of one rank is handed over at the commit: sent, never received."""
    windows, streams, report, reconstructs = replayed(run)
    sends, recvs, handed = Counter(), Counter(), Counter()

    def sent(message: tuple, src: int, dst: int) -> None:
        (handed if src // run["S"] == dst // run["S"] else sends)[message] += 1

    for clock, cmd in instructions(streams):
        if isinstance(cmd, SendActivation):
            j, m = cmd.stage, cmd.micro_batch
            sent(("act", j, j + 1, m, clock), j, j + 1)
            assert report.forward_clock[(j, m)] == clock and report.forward_clock[(j + 1, m)] == clock + 1
        elif isinstance(cmd, RecvActivation):
            recvs[("act", cmd.stage - 1, cmd.stage, cmd.micro_batch, clock)] += 1
        elif isinstance(cmd, SendGrad):
            j, m = cmd.stage, cmd.micro_batch
            sent(("grad", j, j - 1, m, cmd.with_input, clock), j, j - 1)
            assert report.backward_clock[(j, m)] == clock and report.backward_clock[(j - 1, m)] == clock + 1
            assert cmd.with_input == (reconstructs[j - 1] and 0 < j - 1 < run["J"] - 1)
        elif isinstance(cmd, RecvGrad):
            recvs[("grad", cmd.stage + 1, cmd.stage, cmd.micro_batch, cmd.with_input, clock)] += 1
        elif isinstance(cmd, SendTiedGrad):
            sent(("tied_grad", cmd.tie, cmd.stage, cmd.owner, cmd.step, clock), cmd.stage, cmd.owner)
            assert report.steps[cmd.stage][cmd.step - 1] == clock < report.steps[cmd.owner][cmd.step - 1]
        elif isinstance(cmd, RecvTiedGrad):
            recvs[("tied_grad", cmd.tie, cmd.reader, cmd.stage, cmd.step, clock)] += 1
        elif isinstance(cmd, SendTiedWeight):
            sent(("tied_weight", cmd.tie, cmd.stage, cmd.reader, cmd.step, clock), cmd.stage, cmd.reader)
            assert report.steps[cmd.stage][cmd.step - 1] == clock
        elif isinstance(cmd, RecvTiedWeight):
            recvs[("tied_weight", cmd.tie, cmd.owner, cmd.stage, cmd.step, clock)] += 1
    assert sends == recvs
    assert all(count == 1 for count in (sends + handed).values()) and not sends.keys() & handed.keys()
    fed = len(expected_feed(run))
    assert sum(1 for key in sends + handed if key[0] == "act") == fed * (run["J"] - 1)
    assert sum(1 for key in sends + handed if key[0] == "grad") == fed * (run["J"] - 1)
    for key, owner, readers in run["ties"]:
        for reader in readers:
            assert report.tied_weights.get((reader, key), []) == list(range(1, len(report.steps[owner]) + 1))


@settings(max_examples=150, deadline=None)
@given(run=runs())
def test_buffers_follow_reversibility_and_window_boundaries_change_nothing(run):
    """A stage reconstructs every micro-batch exactly when it is reversible, inside the pipeline and
    input_buffer is not "all", and then keeps no FIFO; any other inner stage keeps at most tau_j + 1
    inputs. Cutting the clocks into train_batch calls and drains changes no instruction: there is no
    flush, the schedule depends on the micro-batches fed alone."""
    J = run["J"]
    windows, streams, report, reconstructs = replayed(run)
    fed = len(expected_feed(run))
    rebuilt = Counter(cmd.stage for _clock, cmd in instructions(streams) if isinstance(cmd, ReverseReconstruct))
    for j in range(J):
        inner = 0 < j < J - 1
        reconstructing = inner and run["reversible"][j] and run["input_buffer"] != "all"
        assert rebuilt[j] == (fed if reconstructing else 0)
        if not inner or reconstructing:
            assert report.max_fifo.get(j, 0) == 0
        else:
            assert report.max_fifo.get(j, 0) <= delay(j, J) + 1
            assert fed == 0 or report.max_fifo[j] >= 1
    whole = Window(0, sum(w.clocks for w in windows), windows[-1].feed.total, windows[-1].feed)
    for rank, clocks in streams.items():
        single = PetraSchedule.for_window(whole, run["ranks"], rank, stages_per_rank=run["S"],
                                          gradient_accumulation_steps=run["k"], reversible=reconstructs,
                                          ties=run["ties"])
        assert [[repr(c) for c in cmds] for cmds in single] == [[repr(c) for c in cmds] for cmds in clocks]


@settings(max_examples=40, deadline=None)
@given(J=st.integers(1, 24), k=st.integers(1, 8), calls=st.integers(1, 8))
def test_train_batch_finishes_nothing_for_its_first_floor_of_j_minus_1_over_k_calls(J, k, calls):
    """README: while the pipeline fills, the first floor((J-1)/k) train_batch calls compute no loss
    (the last stage's forward of micro-batch m runs at clock m + J - 1)."""
    timeline = Timeline(J)
    finished = []
    for _ in range(calls):
        window = timeline.train_window(k)
        timeline.advance(window)
        schedule = PetraSchedule.for_window(window, 1, 0, stages_per_rank=J, gradient_accumulation_steps=k)
        finished.append(sum(schedule.forward_at(clock, J - 1) is not None
                            for clock in range(window.start_clock, window.start_clock + k)))
    empty = (J - 1) // k
    assert finished[:empty] == [0] * min(empty, calls)
    assert all(n > 0 for n in finished[empty:])


def _clocks(run: dict, rank: int, templates: ClockTemplates | None) -> list[list[tuple[str, dict]]]:
    """Every clock of ``rank`` over the run's windows, each instruction as (class, fields)."""
    reconstructs = [r and run["input_buffer"] != "all" for r in run["reversible"]]
    return [[(type(c).__name__, vars(c)) for c in cmds]
            for window in windows_of(run)
            for cmds in PetraSchedule.for_window(window, run["ranks"], rank, stages_per_rank=run["S"],
                                                 gradient_accumulation_steps=run["k"], reversible=reconstructs,
                                                 ties=run["ties"], templates=templates)]


@settings(max_examples=150, deadline=None)
@given(run=runs())
def test_a_clock_shifted_from_an_earlier_steady_clock_is_the_clock_the_equations_give(run):
    """The engine derives one steady clock per phase of the steps and shifts it by whole steps from then on
    (``ClockTemplates``, kept across windows): over train_batch calls that feed all, some or none of their clocks,
    drains, ties and every layout, each clock it makes equals the one derived from the equations, field by field."""
    for rank in range(run["ranks"]):
        assert _clocks(run, rank, ClockTemplates()) == _clocks(run, rank, None)


def test_steady_clocks_are_shifted_across_windows_holes_in_the_feed_and_drains():
    """A long run through every case the templates meet (a short call leaves a hole: a new run of fed micro-batches
    with another base for the step count; a drain; ties, a FIFO, reconstructing stages, two ranks): most clocks come
    from templates, and all equal the derived ones."""
    k, plan = 3, [3] * 8 + [2] + [3] * 6 + [DRAIN] + [3] * 7 + [1, 0] + [3] * 6 + [DRAIN]
    run = {"ranks": 2, "S": 2, "J": 4, "k": k, "plan": plan, "reversible": [False, True, False, True],
           "input_buffer": "non_reversible", "ties": [("tie0", 0, (3,))]}
    for rank in range(2):
        templates = ClockTemplates()
        shifted = _clocks(run, rank, templates)
        assert shifted == _clocks(run, rank, None)
        assert 0 < len(templates) <= 2 * k and len(shifted) > 5 * len(templates)

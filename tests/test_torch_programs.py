"""torch.distributed.pipelining's schedules in the timeline: torch's action orders, their costs and
messages, and their bubbles against closed forms."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from deepspeed.runtime.pipe import schedule as ds
from torch.distributed import pipelining

from petra_ds.perf import torch_programs
from petra_ds.perf.costs import Costs, StageCosts
from petra_ds.perf.predict import predict, seconds_per_micro_batch
from petra_ds.perf.programs import simulate_schedule
from petra_ds.perf.torch_programs import (INPUT_GRAD_SHARE, SCHEDULES, TORCH_VARIANTS, UnsupportedMicroBatches,
                                          placement, rank_actions)

FG, B = 1.3, 2.1  # forward with graph, backward (arbitrary units)
ZERO_BUBBLE = ("torch_interleaved_zb", "torch_zbv", "torch_dualpipev")


def _fmt(actions, kinds=None) -> str:
    """torch's notation: ``1F0`` is virtual stage 1's forward of micro-batch 0."""
    return " ".join(f"{v}{kind}{m}" for kind, v, m in actions if kinds is None or kind in kinds)


def _supported(base: str, J: int, k: int) -> bool:
    """torch's constraints as documented: 1F1B k >= J, DualPipeV k >= 2J, interleaved k % rounds == 0."""
    if base == "torch_1f1b":
        return k >= J
    if base == "torch_dualpipev":
        return k >= 2 * J
    if base.startswith("torch_interleaved"):
        return k % max(1, k // J) == 0
    return True


def test_golden_one_f_one_b_with_its_fused_messages():
    """Schedule1F1B's loop at J = 2, k = 4: a send is waited for before the next compute."""
    got = rank_actions("torch_1f1b", 2, 4)
    assert _fmt(got[0]) == ("0F0 0SEND_F0 0F1 0WAIT_SEND_F0 0SEND_F1 0RECV_B0 0WAIT_SEND_F1 0B0 0F2 0SEND_F2 "
                            "0RECV_B1 0WAIT_SEND_F2 0B1 0F3 0SEND_F3 0RECV_B2 0WAIT_SEND_F3 0B2 0RECV_B3 0B3")
    assert _fmt(got[1]) == ("1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1WAIT_SEND_B0 1F1 1B1 1SEND_B1 1RECV_F2 "
                            "1WAIT_SEND_B1 1F2 1B2 1SEND_B2 1RECV_F3 1WAIT_SEND_B2 1F3 1B3 1SEND_B3 1WAIT_SEND_B3")


def test_golden_zbv_order():
    """ScheduleZBVZeroBubble at J = 2, k = 4: rank 0 runs virtual stages 0 and 3, rank 1 stages 1 and 2."""
    got = rank_actions("torch_zbv", 2, 4)
    compute = {"F", "I", "W", "B"}
    assert _fmt(got[0], compute) == ("0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 "
                                     "3F3 3I3 3W3 0I2 0W2 0I3 0W3")
    assert _fmt(got[1], compute) == ("1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 "
                                     "2W2 1I2 2I3 1I3 1W2 2W3 1W3")
    assert "1SEND_F" not in _fmt(got[1])  # virtual stages 1 -> 2 share rank 1: handed over in memory


@pytest.mark.parametrize("J,k", [(2, 4), (3, 3), (4, 9), (5, 7)])
def test_one_f_one_b_order_is_deepspeeds_and_torchs(J, k):
    """The classic 1F1B: DeepSpeed's TrainSchedule's passes, and torch's own ``pipeline_order`` except at
    the last rank, which torch lists from micro-batch 1 (its loop starts there at 0)."""
    acts = rank_actions("torch_1f1b", J, k)
    order = pipelining.Schedule1F1B(SimpleNamespace(stage_index=0, num_stages=J, group_rank=0, group_size=J,
                                                    submod=None), k).pipeline_order
    for s in range(J):
        ours = [(kind, m) for kind, _, m in acts[s] if kind in ("F", "B")]
        passes, counts = [], {"F": 0, "B": 0}
        for cmds in ds.TrainSchedule(micro_batches=k, stages=J, stage_id=s):
            for cmd in cmds:
                kind = {ds.ForwardPass: "F", ds.BackwardPass: "B"}.get(type(cmd))
                if kind:
                    passes.append((kind, counts[kind]))
                    counts[kind] += 1
        assert ours == passes
        if s < J - 1:
            theirs = [(a.computation_type.value, a.microbatch_index) for a in order[s]
                      if a is not None and a.computation_type.value in ("F", "B")]
            assert ours == theirs


def test_placement():
    assert placement("torch_interleaved_zb", 4) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1, 6: 2, 7: 3}
    assert placement("torch_zbv_ckpt", 4) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 2, 6: 1, 7: 0}
    assert placement("torch_1f1b", 3) == {0: 0, 1: 1, 2: 2}
    with pytest.raises(ValueError, match="unknown torch schedule"):
        placement("torch_gpipe", 2)


def test_torchs_micro_batch_constraints():
    with pytest.raises(UnsupportedMicroBatches, match="Schedule1F1B does not run 3 micro-batches on 4 ranks"):
        rank_actions("torch_1f1b", 4, 3)
    with pytest.raises(UnsupportedMicroBatches, match="ScheduleDualPipeV"):
        rank_actions("torch_dualpipev_ckpt", 4, 7)
    with pytest.raises(UnsupportedMicroBatches, match="ScheduleInterleaved1F1B"):
        rank_actions("torch_interleaved_1f1b", 4, 9)
    assert rank_actions("torch_zbv", 4, 1)  # ZBV drops the micro-batches it lacks
    assert predict(Costs.uniform(4, 1.0, FG, B), 4, ["torch_1f1b", "torch_dualpipev"]).keys() == {"torch_1f1b"}


@pytest.mark.parametrize("J", [2, 4, 8])
def test_every_schedule_runs_without_deadlock(J):
    """Random costs, messages, two steps: every virtual stage computes every micro-batch's forward and
    its whole backward once; torch refuses exactly the k it documents."""
    rng = random.Random(J)
    costs = Costs(tuple(StageCosts(1.0, rng.uniform(0.5, 2), rng.uniform(1, 4), rng.uniform(0, 0.5))
                        for _ in range(J)), message_s=0.05)
    for base, (_, per_rank, _) in SCHEDULES.items():
        for k in (J, 2 * J, 4 * J):
            if not _supported(base, J, k):
                with pytest.raises(UnsupportedMicroBatches):
                    simulate_schedule(base, costs, k, 2)
                continue
            sim = simulate_schedule(base, costs, k, 2)
            assert len(sim.batch_ends) == 2 and 0 < sim.batch_ends[0] < sim.batch_ends[1]
            for r in range(J):
                ops = [(e.op, e.micro_batch) for e in sim.events if e.rank == r]
                for m in range(2 * k):
                    assert ops.count(("forward_grad", m)) == per_rank, (base, k, r, m)
                    whole = ops.count(("backward", m)) + ops.count(("backward_weight", m))
                    assert whole == per_rank and ops.count(("backward_input", m)) == per_rank - ops.count(
                        ("backward", m)), (base, k, r, m)


def test_two_chunk_costs_are_halves_of_the_measured_stages():
    """Virtual stage v costs half of stage v // 2: interleaved rank 0 of J = 2 runs virtual stages 0 and 2,
    halves of stages 0 and 1; the split backward gives I its share and W the rest."""
    costs = Costs((StageCosts(1.0, 1.0, 2.0, 0.2), StageCosts(1.0, 3.0, 6.0, 0.6)))
    k = 4
    sim = simulate_schedule("torch_interleaved_zb", costs, k, 1)
    busy = {op: sum(e.end - e.start for e in sim.events if e.rank == 0 and e.op == op)
            for op in ("forward_grad", "backward_input", "backward_weight", "step")}
    assert busy == pytest.approx({"forward_grad": k * (1.0 + 3.0) / 2,
                                  "backward_input": k * INPUT_GRAD_SHARE * (2.0 + 6.0) / 2,
                                  "backward_weight": k * (1 - INPUT_GRAD_SHARE) * (2.0 + 6.0) / 2,
                                  "step": (0.2 + 0.6) / 2})


@pytest.mark.parametrize("base,links", [("torch_1f1b", 2), ("torch_interleaved_1f1b", 5), ("torch_zbv", 4),
                                        ("torch_dualpipev", 4)])
def test_one_transfer_per_message_between_ranks(base, links):
    """J = 3: each micro-batch crosses every link between ranks forward and back (1F1B: 2 links,
    interleaved: 5 between 6 virtual stages, V-shaped: 4, its turn staying on the last rank)."""
    J, k = 3, 6
    sim = simulate_schedule(base, Costs.uniform(J, 1.0, FG, B, message_s=0.1), k, 1)
    assert len([e for e in sim.events if e.op == "message"]) == 2 * links * k


@pytest.mark.parametrize("J,k", [(2, 2), (2, 6), (4, 4), (4, 12)])
def test_one_f_one_b_closed_form(J, k):
    """Uniform costs, free messages: (k + J - 1)(F + B) per step, then the step."""
    step = 0.4
    got = seconds_per_micro_batch("torch_1f1b", Costs.uniform(J, 1.0, FG, B, step=step), k)
    assert got * k == pytest.approx((k + J - 1) * (FG + B) + step)


@pytest.mark.parametrize("J", [2, 4, 8])
def test_zero_bubble_schedules_beat_one_f_one_b(J, monkeypatch):
    """With B = W = backward / 2: never slower than 1F1B, strictly faster once k >= 2J."""
    monkeypatch.setattr(torch_programs, "INPUT_GRAD_SHARE", 0.5)
    costs = Costs.uniform(J, 1.0, FG, B)
    for k in (J, 2 * J, 4 * J):
        p = predict(costs, k, ("torch_1f1b",) + ZERO_BUBBLE)
        for v in ZERO_BUBBLE:
            if v in p:
                assert p[v] <= p["torch_1f1b"] + 1e-9, (v, k)
                if k >= 2 * J:
                    assert p[v] < p["torch_1f1b"] - 1e-9, (v, k)


def test_checkpointing_adds_one_forward_per_micro_batch():
    """One rank: nothing to overlap, so the recompute adds exactly forward_grad per micro-batch."""
    costs = Costs((StageCosts(0.7, FG, B, step=0.3),))
    k = 4
    for base in SCHEDULES:
        plain, ckpt = (seconds_per_micro_batch(v, costs, k) for v in (base, base + "_ckpt"))
        assert ckpt - plain == pytest.approx(FG), base
    assert set(TORCH_VARIANTS) == {b + s for b in SCHEDULES for s in ("", "_ckpt")}

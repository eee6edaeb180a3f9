"""The timeline simulator against closed forms, the real PETRA streams, and its measuring helpers."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn

from petra_ds.perf.time_model import (Costs, StageCosts, main, measure_stage_costs, plot_gantt, predict, revnet_costs,
                                    seconds_per_micro_batch, simulate_schedule, validate)
from petra_ds.perf.predict import predict_host_bound
from petra_ds.perf.programs import micro_batch_seconds
from petra_ds.schedule import PetraSchedule, Timeline, delay

F, FG, B = 1.0, 1.3, 2.1  # forward, forward with graph, backward (arbitrary units)


def random_costs(rng: random.Random, J: int, message_s: float = 0.0, step: bool = True) -> Costs:
    return Costs(tuple(StageCosts(rng.uniform(0.5, 2), rng.uniform(0.6, 2.5), rng.uniform(1, 4),
                                  rng.uniform(0, 1) if step else 0.0) for _ in range(J)), message_s)


def gradients_received_before_backward() -> bool:
    """Whether PETRA's streams post a clock's gradient receive before its backward (the old per-message
    posting: stage 0, which sends no gradient, then never waits for a transfer of its own in steady
    state) rather than in the batch after the backward (every stage waits one transfer after its compute)."""
    J = 3
    window = Timeline(J).train_window(8)
    cmds = [type(c).__name__ for c in PetraSchedule.for_window(window, J, 0).clock_instructions(6)]
    return cmds.index("RecvGrad") < cmds.index("DelayedBackward")


def per_clock(costs: Costs, j: int) -> float:
    """What PETRA's stage j computes each clock in steady state (no step)."""
    s = costs.stages[j]
    return s.forward_grad + s.backward if j == costs.stage_count - 1 else s.forward + s.forward_grad + s.backward


# --- closed forms ---------------------------------------------------------------------------------


@pytest.mark.parametrize("J,k", [(2, 1), (3, 4), (5, 2), (10, 4), (18, 3)])
def test_uniform_closed_forms(J, k):
    costs = Costs.uniform(J, F, FG, B)
    p = predict(costs, k)
    assert p["petra"] == pytest.approx(F + FG + B)
    assert p["1f1b"] * k == pytest.approx((k + J - 1) * (FG + B))
    assert p["gpipe"] * k == pytest.approx((k + J - 1) * (FG + B))
    assert p["1f1b_ckpt"] * k == pytest.approx((k + J - 1) * (FG + FG + B))  # checkpointed forward keeps a graph
    assert p["naive_mp"] == pytest.approx(J * (FG + B))
    assert p["naive_mp_ckpt"] == pytest.approx(J * (FG + FG + B))
    assert p["single"] == pytest.approx(J * (FG + B))
    assert p["single"] / p["petra"] == pytest.approx(J * (FG + B) / (F + FG + B))


@pytest.mark.parametrize("J,k", [(4, 4), (10, 4), (8, 14)])
def test_a_host_bound_rank_runs_at_the_hosts_pace(J, k):
    """Uniform stages, no messages: a host that needs H per stage and micro-batch (PETRA: per stage-clock) sets
    the pace where H exceeds the device's unit, which is then H in the closed forms above; below it, nothing
    changes."""
    costs = Costs.uniform(J, F, FG, B)
    assert predict_host_bound(costs, k, {"petra": 0.0, "1f1b": 0.0, "torch_dualpipev": 0.0}) == pytest.approx(
        predict(costs, k, ["petra", "1f1b", "torch_dualpipev"]))
    H = 3 * (F + FG + B)
    bound = predict_host_bound(costs, k, {"petra": H, "1f1b": H, "1f1b_ckpt": H})
    assert bound["petra"] == pytest.approx(H)
    assert bound["1f1b"] * k == pytest.approx((k + J - 1) * H)
    assert bound["1f1b_ckpt"] * k == pytest.approx((k + J - 1) * H)
    slow_device = Costs.uniform(J, 10 * F, 10 * FG, 10 * B)
    assert predict_host_bound(slow_device, k, {"petra": H})["petra"] == pytest.approx(10 * (F + FG + B))


def test_a_host_bound_unit_is_spread_over_its_primitives_in_proportion():
    costs = Costs((StageCosts(F, FG, B, step=0.5, backward_split=2 * B), StageCosts(F, FG, B)))
    H = 2 * (F + FG + B)
    bound = costs.host_bound(H, lambda c, j, J: micro_batch_seconds("petra", c, j, J))
    first, last = bound.stages
    assert (first.forward, first.forward_grad, first.backward, first.backward_split, first.step) == pytest.approx(
        (2 * F, 2 * FG, 2 * B, 4 * B, 0.5))
    assert last.forward_grad + last.backward == pytest.approx(H)  # the last stage's clock has no forward
    with pytest.raises(ValueError, match="1f1b_rev"):
        micro_batch_seconds("1f1b_rev", costs.stages[0], 0, 2)


def test_petra_speedup_over_pipelines_grows_towards_its_limit():
    """1F1B approaches PETRA's per-clock cost only as k grows (its bubble is (J-1)/k)."""
    J = 8
    costs = Costs.uniform(J, F, FG, B)
    ratios = [predict(costs, k, ["1f1b"])["1f1b"] for k in (1, 4, 16, 64)]
    assert ratios == sorted(ratios, reverse=True)
    assert ratios[-1] == pytest.approx((FG + B) * (64 + J - 1) / 64)


@pytest.mark.parametrize("J,k,seed", [(3, 2, 0), (6, 4, 1), (9, 1, 2), (12, 5, 3)])
def test_petra_runs_at_the_pace_of_its_slowest_stage(J, k, seed):
    costs = random_costs(random.Random(seed), J, message_s=0.05, step=False)
    m = costs.message_s
    if gradients_received_before_backward():  # a stage j > 0 sends its gradient after its compute
        expected = max([per_clock(costs, 0)] + [per_clock(costs, j) + m for j in range(1, J)])
    else:
        expected = max(per_clock(costs, j) for j in range(J)) + m
    got = seconds_per_micro_batch("petra", costs, k, reversible=[False] * J)
    assert got == pytest.approx(expected)


def test_petra_pace_with_nearly_balanced_stages():
    """The stages after the slowest one can run ahead of it for thousands of clocks when they are only
    slightly faster; the prediction is still the slowest stage's pace (k = 1: every stage steps every clock)."""
    J = 10
    stages = [StageCosts(F, FG, B, step=0.0)] * J
    stages[1] = StageCosts(F, FG + 0.002, B, step=0.0005)
    stages[8] = StageCosts(F, FG, B, step=0.0015)
    costs = Costs(tuple(stages))
    expected = max(per_clock(costs, j) + costs.stages[j].step for j in range(J))
    assert seconds_per_micro_batch("petra", costs, 1, reversible=[j % 3 != 0 for j in range(J)]) == pytest.approx(expected)


def test_petra_gradient_with_reconstructed_input_is_two_messages():
    """A reversible stage j-1 needs (delta_j, x~_{j-1}): twice the activation's size on that link."""
    J, m = 5, 0.1
    costs = Costs.uniform(J, F, FG, B, message_s=m)
    assert seconds_per_micro_batch("petra", costs, 4, reversible=[True] * J) == pytest.approx(F + FG + B + 2 * m)
    assert seconds_per_micro_batch("petra", costs, 4, reversible=[False] * J) == pytest.approx(F + FG + B + m)


def test_petra_stages_sharing_a_rank_run_one_after_the_other():
    """stages_per_rank S: a rank computes its S stages in turn each clock (S = J: one process)."""
    J, m = 4, 0.1
    costs = Costs.uniform(J, F, FG, B, message_s=m)
    c = F + FG + B
    assert seconds_per_micro_batch("petra", costs, 3, stages_per_rank=4) == pytest.approx(3 * c + FG + B)
    # rank 1 sends (delta_2, x~_1) to rank 0 after its compute: two messages, which rank 0 waits for after
    # its own compute unless it posted their receive before its backward
    rank0 = 2 * c if gradients_received_before_backward() else 2 * c + 2 * m
    assert seconds_per_micro_batch("petra", costs, 3, stages_per_rank=2) == pytest.approx(
        max(rank0, c + FG + B + 2 * m))


def test_naive_model_parallelism_with_messages_and_steps():
    J, m, step = 6, 0.1, 0.4
    costs = Costs.uniform(J, F, FG, B, step=step, message_s=m)
    # one micro-batch crosses every stage forward and back, then stage 0's step (the others step earlier)
    assert predict(costs, 4, ["naive_mp"])["naive_mp"] == pytest.approx(J * (FG + B) + 2 * (J - 1) * m + step)


def test_one_f_one_b_messages_are_bounded():
    """Blocking p2p: at least the fill and drain messages, at most four per step of the schedule."""
    J, k, m = 5, 6, 0.1
    got = seconds_per_micro_batch("1f1b", Costs.uniform(J, F, FG, B, message_s=m), k) * k
    base = (k + J - 1) * (FG + B)
    assert base + 2 * (J - 1) * m - 1e-9 <= got <= base + 4 * (k + J - 1) * m + 1e-9


def test_reversible_backprop_recomputes_only_at_reversible_stages():
    J, rev = 5, [False, True, True, False, False]
    costs = Costs.uniform(J, F, FG, B)
    got = seconds_per_micro_batch("naive_mp_rev", costs, 3, reversible=rev)
    assert got == pytest.approx(2 * (F + FG + B) + 3 * (FG + B))
    assert predict(costs, 3, ["1f1b_rev", "1f1b_ckpt"]) == pytest.approx(
        {"1f1b_rev": (3 + J - 1) * (F + FG + B) / 3, "1f1b_ckpt": (3 + J - 1) * (FG + FG + B) / 3})


@pytest.mark.parametrize("J,k", [(4, 8), (5, 3), (8, 16)])
def test_held_micro_batches_follow_each_schedules_definition(J, k):
    """1F1B's rank r holds min(J - r, k) micro-batches, GPipe all k on every rank; PETRA's stage 0 keeps the
    tau_0 + 1 inputs it re-reads, a reversible middle stage nothing, a non-reversible one tau_j + 1 inputs,
    the last stage one graph within its clock."""
    costs = Costs.uniform(J, F, FG, B)
    assert simulate_schedule("1f1b", costs, k, 2).held_micro_batches() == {r: min(J - r, k) for r in range(J)}
    assert simulate_schedule("gpipe", costs, k, 2).held_micro_batches() == {r: k for r in range(J)}
    reversible = [True] * J
    reversible[1] = False
    petra = simulate_schedule("petra", costs, k, 3, reversible=reversible).held_micro_batches()
    assert petra == {r: (delay(r, J) + 1 if r in (0, 1) else 1 if r == J - 1 else 0) for r in range(J)}


def test_deepspeed_backward_per_output_tensor():
    """DeepSpeed runs a non-last stage's BackwardPass once per output tensor: backward_split instead of
    backward there (recomputation scaled alike), never at the last stage, never in PETRA."""
    J, split = 3, 2.5 * B
    costs = Costs((StageCosts(F, FG, B, backward_split=split),) * J)
    assert predict(costs, 2, ["naive_mp"])["naive_mp"] == pytest.approx(J * FG + (J - 1) * split + B)
    assert predict(costs, 2, ["naive_mp_ckpt"])["naive_mp_ckpt"] == pytest.approx(
        J * FG + (J - 1) * (FG + B) * split / B + FG + B)
    assert predict(costs, 2, ["petra"])["petra"] == pytest.approx(F + FG + B)
    assert Costs.from_dict(costs.to_dict()) == costs
    assert "backward_split" not in Costs.uniform(2, F, FG, B).to_dict()["stages"][0]


def test_single_process_counts_the_steps_once_per_k():
    costs = Costs.uniform(3, F, FG, B, step=0.6)
    assert predict(costs, 4, ["single"])["single"] == pytest.approx(3 * (FG + B + 0.6 / 4))


# --- properties -----------------------------------------------------------------------------------


def test_more_cost_never_runs_faster():
    rng = random.Random(7)
    J, k = 5, 3
    for _ in range(4):
        costs = random_costs(rng, J, message_s=0.05)
        base = predict(costs, k)
        j = rng.randrange(J)
        field = rng.choice(["forward", "forward_grad", "backward", "step"])
        stages = list(costs.stages)
        stages[j] = StageCosts(**{**stages[j].__dict__, field: getattr(stages[j], field) + rng.uniform(0.1, 2)})
        for slower in (Costs(tuple(stages), costs.message_s), Costs(costs.stages, costs.message_s + 0.2)):
            after = predict(slower, k)
            assert after.keys() == base.keys() and "torch_zbv" in base  # torch's 1F1B and DualPipeV refuse k < J
            for v in base:
                assert after[v] >= base[v] - 1e-9, (v, field, j)


@pytest.mark.parametrize("schedule", ["petra", "1f1b", "gpipe", "naive_mp", "1f1b_ckpt"])
def test_no_deadlock_up_to_18_stages(schedule):
    rng = random.Random(3)
    for J in range(1, 19):
        k = rng.choice([1, 2, 5])
        sim = simulate_schedule(schedule, random_costs(rng, J, message_s=0.01), k, 2, drain=schedule == "petra")
        ends = sim.batch_ends  # PETRA: two windows and the drain
        assert len(ends) == (3 if schedule == "petra" else 2) and 0 < ends[0] <= ends[1] <= ends[-1]


def _passes(sim, stage):
    fwd = [e.micro_batch for e in sim.events if e.stage == stage and e.op in ("forward", "forward_grad")]
    bwd = [e.micro_batch for e in sim.events if e.stage == stage and e.op == "backward"]
    return fwd, bwd


@pytest.mark.parametrize("J,k,batches", [(1, 3, 2), (4, 3, 3), (7, 2, 4), (10, 4, 2)])
def test_petra_streams_give_one_forward_and_one_backward_per_micro_batch(J, k, batches):
    reversible = [j % 3 != 0 for j in range(J)]
    sim = simulate_schedule("petra", Costs.uniform(J, F, FG, B, step=0.3, message_s=0.1), k, batches,
                            reversible=reversible, drain=True)
    n = k * batches
    start = {(e.stage, e.op, e.micro_batch): e.start for e in sim.events}
    end = {(e.stage, e.op, e.micro_batch): e.end for e in sim.events}
    for j in range(J):
        fwd, bwd = _passes(sim, j)
        assert fwd == list(range(n)) and bwd == list(range(n))
        rebuild = [e.micro_batch for e in sim.events if e.stage == j and e.op in ("reconstruct", "recompute")]
        assert rebuild == ([] if j == J - 1 else list(range(n)))
        assert len([e for e in sim.events if e.stage == j and e.op == "step"]) == batches
        for m in range(n):
            f_op = "forward_grad" if j == J - 1 else "forward"
            if j > 0:  # the input arrived from stage j-1, one message later
                prev = "forward_grad" if j - 1 == J - 1 else "forward"
                assert start[(j, f_op, m)] >= end[(j - 1, prev, m)] + 0.1 - 1e-9
            assert start[(j, "backward", m)] >= end[(j, f_op, m)]
            if j < J - 1:  # delta_{j+1} arrived from stage j+1
                assert start[(j, "backward", m)] >= end[(j + 1, "backward", m)] + 0.1 - 1e-9


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "naive_mp", "gpipe_ckpt"])
def test_deepspeed_schedules_give_one_forward_and_one_backward_per_micro_batch(schedule):
    J, k = 4, 3
    sim = simulate_schedule(schedule, Costs.uniform(J, F, FG, B, message_s=0.1), k, 2)
    n = 2 if schedule == "naive_mp" else 2 * k
    for j in range(J):
        assert _passes(sim, j) == (list(range(n)), list(range(n)))


# --- validation, measurement, plots, command line -------------------------------------------------


def _synthetic_report(errors: dict[str, float]) -> dict:
    costs = Costs((StageCosts(0.010, 0.012, 0.020, 0.004), StageCosts(0.011, 0.013, 0.025, 0.003)), 0.002)
    size, k = 8, 4
    variants = {}
    for name, e in errors.items():
        predicted = size / seconds_per_micro_batch(name, costs, k)
        variants[name] = {"samples_per_s": predicted / (1 + e)}
    variants["zero_bubble"] = {"samples_per_s": 1.0}
    return {"costs": costs.to_dict(), "variants": variants, "micro_batch_size": size, "micro_batches": k, "stages": 2}


def test_validate_reports_relative_errors():
    errors = {"single": 0.05, "naive_mp": -0.1, "1f1b": 0.2, "1f1b_ckpt": 0.0, "petra": 0.12}
    result = validate(_synthetic_report(errors))
    assert result["skipped"] == ["zero_bubble"]
    for name, e in errors.items():
        assert result["variants"][name]["relative_error"] == pytest.approx(e)
    assert result["max_abs_relative_error"] == pytest.approx(0.2)
    assert not result["within_tolerance"]
    report = _synthetic_report(errors)
    report["costs"]["stages"][0]["backward_split"] = 0.035  # stage 0 outputs a pair of streams
    report["ds_streams"] = "stacked"  # DeepSpeed got one tensor: one backward call, as before
    assert validate(report)["variants"]["1f1b"]["relative_error"] == pytest.approx(0.2)
    report["ds_streams"] = "pair"
    paired = validate(report)["variants"]
    assert paired["1f1b"]["predicted_samples_per_s"] < result["variants"]["1f1b"]["predicted_samples_per_s"]
    assert paired["petra"]["relative_error"] == pytest.approx(0.12)
    report["stages"] = 3
    with pytest.raises(ValueError, match="3 stages"):
        validate(report)
    del report["costs"]
    with pytest.raises(ValueError, match="--no-costs"):
        validate(report)


@pytest.fixture
def one_thread():
    """Two threads spin against the other tests' processes on a 2-core machine: 50x slower ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_measure_stage_costs_leaves_the_stage_untouched(one_thread):
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 32)).train()
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    x = torch.randn(16, 32)
    rng = torch.get_rng_state()
    costs = measure_stage_costs(stage, x, repeats=2)
    assert set(costs) == {"forward", "forward_grad", "backward", "step"}
    assert all(v > 0 for v in costs.values())
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in stage.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in stage.parameters())

    class Holder:  # like a petra_ds Stage: its run() is a bound method over a list of layers
        def __init__(self):
            self.layers = [nn.Linear(32, 32), nn.BatchNorm1d(32)]

        def run(self, inp):
            for layer in self.layers:
                inp = layer(inp)
            return inp

    pair = nn.Linear(32, 32)
    both = measure_stage_costs(lambda t: (pair(t), pair(t).relu()), x, list(pair.parameters()), repeats=1)
    assert both["backward_split"] > 0 and "backward_split" not in costs
    assert measure_stage_costs(nn.ReLU(), x, repeats=1)["step"] == 0.0

    holder = Holder()
    stats = holder.layers[1].running_mean.clone()
    params = [p for layer in holder.layers for p in layer.parameters()]
    assert measure_stage_costs(holder.run, x, params, repeats=1)["step"] > 0
    assert torch.equal(holder.layers[1].running_mean, stats) and all(p.grad is None for p in params)

    head = nn.Linear(32, 5)
    head.weight.grad = torch.ones_like(head.weight)
    last = measure_stage_costs([nn.ReLU(), head], x, loss_fn=nn.functional.cross_entropy,
                               labels=torch.randint(0, 5, (16,)), repeats=1, input_grad=False,
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert all(v > 0 for v in last.values())
    assert torch.equal(head.weight.grad, torch.ones_like(head.weight)) and head.bias.grad is None


def test_revnet_costs_follow_the_papers_partition(one_thread):
    costs, reversible, names = revnet_costs(18, micro_batch=2, image=16, base_width=4, repeats=1)
    assert costs.stage_count == 10 and len(names) == 10
    assert [j for j, r in enumerate(reversible) if not r] == [0, 3, 5, 7, 9]
    assert all(s.backward > 0 and s.step > 0 for s in costs.stages)


def test_gantt_and_command_line(tmp_path):
    sim = simulate_schedule("petra", Costs.uniform(3, F, FG, B, message_s=0.1), 2, 2, drain=True)
    png = plot_gantt([sim], str(tmp_path / "g.png"), "test")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    result = main(["--uniform", "--stages", "3", "--micro-batches", "2", "--out-dir", str(tmp_path)])
    assert result["ms_per_micro_batch"]["petra"] == pytest.approx(1 + 1 + 2)
    assert (tmp_path / "timeline_uniform_J3_k2_gantt.png").exists()
    report = tmp_path / "throughput.json"
    report.write_text(json.dumps(_synthetic_report({"petra": 0.1, "1f1b": -0.05})))
    result = main(["--validate", str(report), "--out-dir", str(tmp_path), "--no-gantt"])
    assert result["variants"]["petra"]["relative_error"] == pytest.approx(0.1)
    assert json.loads((tmp_path / "timeline_validation_throughput.json").read_text())["within_tolerance"]


def test_the_command_line_leaves_the_committed_results_alone(tmp_path, monkeypatch):
    """Without --out-dir the report goes to runs/benchmarks/ (made if missing), never benchmarks/results/."""
    monkeypatch.chdir(tmp_path)
    main(["--uniform", "--stages", "2", "--micro-batches", "2", "--no-gantt"])
    assert (tmp_path / "runs" / "benchmarks" / "timeline_uniform_J2_k2.json").exists()
    assert not (tmp_path / "benchmarks").exists()


def test_extrapolating_a_report_to_more_stages(tmp_path, capsys):
    """A report's stages repeated in order to J stages; torch's schedules that refuse k show n/a."""
    costs = Costs((StageCosts(F, FG, B, 0.1), StageCosts(F, 2 * FG, B, 0.2)), 0.01)
    assert [s.forward_grad for s in costs.stretched(5).stages] == [FG, FG, FG, 2 * FG, 2 * FG]
    assert costs.stretched(5).message_s == 0.01 and costs.stretched(2) == costs
    report = tmp_path / "throughput.json"
    report.write_text(json.dumps(_synthetic_report({"petra": 0.0})))
    result = main(["--extrapolate", str(report), "--to-stages", "3", "4", "--k", "3", "--no-gantt",
                   "--out-dir", str(tmp_path)])
    at3, at4 = result["ms_per_micro_batch"]["3"]["3"], result["ms_per_micro_batch"]["4"]["3"]
    assert "torch_1f1b" in at3 and "torch_1f1b" not in at4 and "torch_dualpipev" not in at3
    stretched = Costs.from_dict(json.loads(report.read_text())["costs"]).stretched(4)
    assert at4["torch_zbv"] == pytest.approx(1e3 * seconds_per_micro_batch("torch_zbv", stretched, 3))
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines()]
    assert ["torch_dualpipev_ckpt", "n/a"] in rows and ["torch_1f1b", "n/a"] in rows  # at J = 4
    assert (tmp_path / "timeline_extrapolate_throughput.json").exists()

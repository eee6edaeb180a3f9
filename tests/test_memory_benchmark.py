"""The held-bytes instrument (petra_ds.diagnostics.held) and the held-memory benchmark (python -m benchmarks.memory).

Oracles: exact byte counts on hand-built graphs; PETRA's reversible stages hold no activation at any clock
end; the input-buffer ablation holds 2(J-1-j) inputs of known size at stage j (and agrees with the
engine's ledger); the weight-stashing ablation holds as many parameter copies; 1F1B's stage j holds
min(k, J-j) micro-batches' activations, so its first stage holds min(k, J).
"""

import os

import pytest
import torch

from petra_ds.diagnostics.held import HeldTracker, StepObserved, activations

from benchmarks.lib import memory_held, memory_worker
from benchmarks.lib.memory_worker import launch
F64 = 8


# --- the tracker on hand-built graphs ---

def test_tracker_counts_exactly_the_tensors_a_graph_saves():
    tracker = HeldTracker()
    w = torch.nn.Parameter(torch.randn(5, 7, dtype=torch.float64))
    with tracker.recording():
        a = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
        b = a * w  # saves a and w (a parameter: never counted)
        c = b.tanh()  # saves its output c
        loss = (c * c).sum()  # saves c twice: one storage
    assert tracker.measure({}, exclude=[w]) == {"graph": 2 * 35 * F64}
    assert tracker.measure({}) == {"graph": 3 * 35 * F64}  # w counts once not excluded
    loss.backward()
    assert tracker.measure({}, exclude=[w]) == {"graph": 0}  # a, c still alive here, but no graph holds them


def test_tracker_keeps_the_graph_high_water_mark_between_measures():
    w = torch.nn.Parameter(torch.randn(5, 7, dtype=torch.float64))
    tracker = HeldTracker(exclude=[w])
    with tracker.recording():
        a = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
        loss = ((a * w).tanh() ** 2).sum()  # saves a, w (excluded), tanh's output, its square's input (the same)
        assert tracker.live_bytes == tracker.peak_bytes == 2 * 35 * F64
        loss.backward()
        assert tracker.live_bytes == 0
        small = (a[:2] * 3.0).exp()  # a view's product: a new 2 x 7 storage
    assert tracker.live_bytes == 14 * F64
    assert tracker.reset_peak() == 2 * 35 * F64
    assert tracker.peak_bytes == 14 * F64  # the next peak starts from what is live
    del small
    assert tracker.live_bytes == 0 and tracker.measure({}) == {"graph": 0}


def test_tracker_counts_a_storage_once_in_the_first_category_that_holds_it():
    tracker = HeldTracker()
    with tracker.recording():
        x = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
        view = x[:, :3]
        y = view.exp()  # saves its output y (own storage)
        z = (x[:, 5:] * 2.0).sin()  # saves the input: a new storage of 4 x 5
    held = tracker.measure({"inputs": [x, view], "outputs": (y,), "messages": {"m": [y, z]}})
    assert held == {"inputs": 40 * F64, "outputs": 12 * F64, "messages": 20 * F64, "graph": 20 * F64}
    del y, z
    assert tracker.measure({})["graph"] == 0  # an output saved by its own op: no reference cycle
    assert activations({"inputs": 1, "outputs": 2, "graph": 4, "data": 8, "messages": 16}) == 7


def test_observed_schedule_reports_after_each_step_has_run():
    class FakePipelineEngine:
        def __init__(self):
            self.log = []

        def _exec_schedule(self, schedule):
            self.log.append(("buffers", schedule.num_pipe_buffers()))
            for cmds in schedule:
                self.log.extend(cmds)

    class FakeEngine(StepObserved, FakePipelineEngine):
        pass

    class Schedule:
        def num_pipe_buffers(self):
            return 2

        def __iter__(self):
            return iter([["load", "forward"], [], ["backward"]])

    engine = FakeEngine()
    engine.pipeline_step_observers = [lambda eng, step: eng.log.append(("observed", step))]
    engine._exec_schedule(Schedule())
    engine._exec_schedule(Schedule())
    assert engine.log[:6] == [("buffers", 2), "load", "forward", ("observed", 0), ("observed", 1), "backward"]
    assert engine.log[6:] == [("observed", 2), ("buffers", 2), "load", "forward", ("observed", 3), ("observed", 4),
                              "backward", ("observed", 5)]


# --- the four methods on a tiny RevGPT, one stage per process ---

TINY = {"micro_batch": 2, "seq_len": 6, "d_model": 8, "n_heads": 2, "vocab_size": 11, "mlp_ratio": 2,
        "dropout": 0.1, "layers_per_stage": 2}


@pytest.fixture(scope="module", params=[
    pytest.param((3, 4), id="J3-k4"),
    pytest.param((4, 2), id="J4-k2", marks=pytest.mark.slow),
    pytest.param((8, 8), id="J8-k8", marks=pytest.mark.slow),
])
def run(request):
    J, k = request.param
    from harness import launch as pooled

    spec = {**TINY, "J": J, "k": k, "train_batches": max(2, -(-2 * J // k))}  # PETRA reaches its steady state
    # pooled ranks: these tests read the held bytes of the run's own graphs, which a reused process does not
    # change (the allocator peaks of the slow test below come from fresh processes)
    return spec, pooled(spec, world_size=J, target=memory_worker.run_rank)


def test_petra_reversible_stages_hold_no_activation_at_any_clock_end(run):
    spec, results = run
    J = spec["J"]
    clocks = spec["train_batches"] * spec["k"]
    for j in range(J):
        r = results[j]["petra"]
        assert r["trace"]["at"] == list(range(clocks))
        assert r["reconstructs"] == (0 < j < J - 1)
        if r["reconstructs"]:
            assert r["layers"] == ["RevGPTBlock", "RevGPTBlock"]
            assert r["trace"]["activations"] == [0] * clocks
        one = results[j]["1f1b"]["first_activations"]
        for method in ("petra", "delayed_ckpt", "delayed_stash"):  # no graph outlives its clock, anywhere
            assert results[j][method]["trace"]["graph"] == [0] * clocks
            # inside a clock a stage builds one micro-batch's graph at most (reconstruction or recompute)
            assert 0 < results[j][method]["peak"]["graph_transient"] < one


def test_ablations_hold_delay_many_inputs_and_parameter_copies(run):
    spec, results = run
    J = spec["J"]
    stream = spec["micro_batch"] * spec["seq_len"] * spec["d_model"] * 4  # one fp32 residual stream
    ids = spec["micro_batch"] * spec["seq_len"] * 8
    for j in range(J):
        delay = 2 * (J - 1 - j)
        for method in ("petra", "delayed_ckpt", "delayed_stash"):
            r = results[j][method]
            assert r["ledger_mismatches"] == [], (j, method)  # tracker == memory_report() at every clock
            buffered = method != "petra" and 0 < j < J - 1
            assert r["peak_in_flight"]["fifo"] == (delay if buffered else 0), (j, method)
            assert r["peak"]["inputs"] == (delay * 2 * stream if buffered else 0), (j, method)
            # the ledger's peak is inside a clock, where the forward pushes before the backward pops
            assert r["ledger_peaks"]["input_buffer_peak"] == ((delay + 1) * 2 * stream if buffered else 0)
            assert r["peak_in_flight"]["raw"] == (delay if j == 0 else 0)
            assert r["peak"]["data"] == (delay * ids if j == 0 else 0)  # stage 0 keeps data, not activations
            stashed = delay if method == "delayed_stash" else 0
            assert r["peak_in_flight"]["stash"] == stashed
            assert r["peak"]["param_stash"] == stashed * r["param_bytes"]


def test_1f1b_stage_j_holds_min_k_and_J_minus_j_micro_batches(run):
    spec, results = run
    J, k = spec["J"], spec["k"]
    for j in range(J - 1):  # DeepSpeed's last stage also keeps its last logits buffers: no exact multiple
        r = results[j]["1f1b"]
        one = r["first_activations"]
        assert one > 0
        assert r["peak"]["activations"] == min(k, J - j) * one, j
    assert results[0]["1f1b"]["peak"]["activations"] == min(k, J) * results[0]["1f1b"]["first_activations"]


def test_benchmark_summary_table_and_plot(run, tmp_path):
    spec, results = run
    J, k = spec["J"], spec["k"]
    summary = memory_held.summarize(J, k, results)
    assert summary["methods"]["1f1b"][0]["activations_peak_mb"] == min(k, J)
    assert summary["methods"]["petra"][1]["activations_peak_mb"] == 0
    assert "1f1b" in memory_held.table(summary)
    assert "J=" in memory_held.growth([summary], 0)
    assert os.path.getsize(memory_held.plot([summary], str(tmp_path / "m.png"), "test")) > 0


@pytest.mark.slow
def test_a_reversible_stage_peak_does_not_grow_with_J():
    """The allocator's peak of every process hosting a middle (reversible) PETRA stage, everything it holds
    (its blocks, gradients, optimizer state, messages, the graph it rebuilds): flat from J = 3 to J = 8,
    within 10%; DeepSpeed's 1F1B first stage, on the same layers, holds more activations as J grows."""
    peaks, first_1f1b = [], {}
    for J in (3, 5, 8):
        results = launch({**TINY, "J": J, "k": J, "train_batches": 2, "methods": ["petra", "1f1b"], "trace": False})
        peaks += [(J, j, r["petra"]["allocated"]["peak"]) for j, r in enumerate(results) if r["petra"]["reconstructs"]]
        first_1f1b[J] = results[0]["1f1b"]["allocated"]["parts"]["other"]
    assert {J for J, _, _ in peaks} == {3, 5, 8}
    values = [peak for _, _, peak in peaks]
    assert max(values) <= 1.10 * min(values), peaks
    assert first_1f1b[3] < first_1f1b[5] < first_1f1b[8], first_1f1b

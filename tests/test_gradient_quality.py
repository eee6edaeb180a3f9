"""The gradient-quality study (App. B) against oracles: known equalities and an independent autograd."""

import math

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

import petra_ds
from petra_ds.diagnostics import gradient_quality as gq
from petra_ds.schedule import delay
from petra_ds.tools.toy import toy_data

import oracle
from harness import launch, model_for, parameter_names

SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
SGD0 = {"type": "SGD", "params": {"lr": 0.0}}


def _engine(J=4, k=2, optimizer=SGD, petra=None, dropout=0.1, extra=None):
    """PETRA on the toy model, every stage in this process (a one-rank world), float64."""
    torch.set_default_dtype(torch.float64)
    layer_specs, loss_fn, _ = model_for({"model": "toy", "dropout": dropout})
    model = petra_ds.PetraPipelineModule(
        layer_specs, topology=PipeDataParallelTopology(num_pp=1, num_dp=1), loss_fn=loss_fn,
        stages_per_rank=J, partition_method="uniform", base_seed=1234)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": k, "optimizer": optimizer,
              "steps_per_print": 10**9,
              "petra": {"stages_per_rank": J, "gradient_quality_every": 2, **(petra or {})}, **(extra or {})}
    engine, *_ = petra_ds.initialize(model=model, config=config)
    engine.gradient_quality.keep_vectors = True
    return engine, model, parameter_names(model)


def _train(engine, batches, data):
    it = iter(data)
    for _ in range(batches):
        engine.train_batch(it)
    engine.drain()


def test_end_to_end_gradient_equals_autograd_with_the_weights_of_that_clock(world_of_one):
    """lr > 0: the e2e gradient of stage j = plain autograd of the whole model with every stage's
    parameters as they were at stage j's backward clock; the reported numbers are those of the vectors."""
    J, k, batches = 4, 2, 5
    engine, model, names = _engine(J, k)
    snapshots = {0: {names[id(p)]: p.detach().clone() for p in model.parameters()}}
    engine.clock_observers.append(lambda eng, clock: snapshots.__setitem__(
        clock + 1, {names[id(p)]: p.detach().clone() for p in model.parameters()}))
    data = toy_data(k * batches, 4)
    _train(engine, batches, data)
    probe = engine.gradient_quality
    followed = sorted({r["micro_batch"] for r in probe.records})
    assert followed == [0, 2 * k, 4 * k]  # every 2 steps, the window's first micro-batch
    assert len(probe.records) == J * len(followed)
    stages = oracle.build_stages(J, dropout=0.1)
    loss = torch.nn.CrossEntropyLoss()
    for m in followed:
        for j in range(J):
            clock = m + j + delay(j, J)
            for stage in stages:
                for n, p in oracle.named_params(stage).items():
                    p.data.copy_(snapshots[clock][n])
            ref = oracle.autograd_group_grads(stages, data, [m], 0, loss=loss)[j]
            st = engine.stages[j]
            vectors = probe.vectors[(m, j)]
            e2e = vectors["e2e"]
            assert len(e2e) == len(st.params)
            for p, g in zip(st.params, e2e):
                assert (g - ref[names[id(p)]]).abs().max() < 1e-10, (m, j, names[id(p)])
            row = next(r for r in probe.records if r["micro_batch"] == m and r["stage"] == j)
            assert row["cos_petra_e2e"] == pytest.approx(gq.cosine(vectors["petra"], e2e), abs=1e-12)
            assert row["norm_delayed_e2e"] == pytest.approx(gq.norm_ratio(vectors["delayed"], e2e), abs=1e-12)
    last = [r for r in probe.records if r["stage"] == J - 1]
    # the last stage computes forward and backward in one clock: PETRA's gradient is the delayed one
    assert all(r["cos_petra_delayed"] == pytest.approx(1, abs=1e-12) for r in last)
    # and the study sees the staleness where it exists: stage 0's PETRA gradient is not the e2e one
    late = [r for r in probe.records if r["stage"] == 0 and r["micro_batch"] > 0]
    assert all(r["cos_petra_e2e"] < 1 - 1e-6 for r in late)
    reconstructs = {j for j, st in engine.stages.items() if st.reconstructs}
    assert reconstructs == {1}
    assert all(r["reconstruction_error"] > 1e-8 for r in probe.records if r["stage"] == 1 and r["micro_batch"] > 0)
    assert all(r["reconstruction_error"] == 0 for r in probe.records if r["stage"] != 1)


def test_with_both_buffers_petra_is_the_delayed_gradient(tmp_path, world_of_one):
    """input_buffer "all" + param_buffer (PipeDream): PETRA's gradient is exactly the delayed one. The
    numbers also reach DeepSpeed's monitor (here its CSV writer)."""
    monitor = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "gq"}}
    engine, _, _ = _engine(petra={"input_buffer": "all", "param_buffer": True}, extra=monitor)
    _train(engine, 5, toy_data(10, 4))
    rows = engine.gradient_quality.records
    assert rows
    for r in rows:
        assert r["cos_petra_delayed"] == pytest.approx(1, abs=1e-12)
        assert r["norm_petra_delayed"] == pytest.approx(1, abs=1e-12)
        assert r["reconstruction_error"] == 0
    logged = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.csv"))
    assert any("GradientQuality" in p and "stage_1" in p and "cos_petra_e2e" in p for p in logged), logged
    engine2, _, _ = _engine()  # the same run without buffers: the approximation shows at stage 1
    _train(engine2, 5, toy_data(10, 4))
    stage1 = [r for r in engine2.gradient_quality.records if r["stage"] == 1 and r["micro_batch"] > 0]
    assert all(r["cos_petra_delayed"] < 1 - 1e-8 for r in stage1)


def _records(engine):
    return engine.gradient_quality.records


def test_across_processes_with_lr0_the_three_gradients_agree():
    """2 ranks x 2 stages: the e2e pass crosses ranks; with lr = 0 nothing is stale, so all three
    gradients are equal and the reconstruction exact (to rounding); every rank holds the records."""
    results = launch({"pipe": 2, "stages_per_rank": 2, "k": 2, "train_batches": 4, "optimizer": SGD0,
                      "petra": {"gradient_quality_every": 1}, "capture_grads": False,
                      "probe": "test_gradient_quality:_records"})
    rows = results[0]["probe"]
    assert repr(rows) == repr(results[1]["probe"])  # repr: NaN != NaN
    assert sorted({r["micro_batch"] for r in rows}) == [0, 2, 4, 6]
    assert sorted({r["stage"] for r in rows}) == [0, 1, 2, 3]
    for r in rows:
        for key in gq.metric_keys(r):
            if key.startswith("cos_update_"):  # lr = 0: every update is 0, its direction undefined
                assert math.isnan(r[key]), (r, key)
                continue
            expected = 0 if key == "reconstruction_error" else 1
            assert r[key] == pytest.approx(expected, abs=1e-9), (r, key)


def test_under_fp16_the_probe_compares_unscaled_gradients():
    """fp16 with each stage's loss scale at 2^16, lr = 0: PETRA's gradient (read from a scaled .grad) and the two
    references (VJPs run with the same scale) agree to fp16's rounding, in direction and in norm."""
    rows = launch({"pipe": 1, "stages_per_rank": 4, "k": 2, "train_batches": 4, "optimizer": SGD0,
                   "dtype": "float32", "config": {"fp16": {"enabled": True}},
                   "petra": {"gradient_quality_every": 1}, "capture_grads": False,
                   "probe": "test_gradient_quality:_records"})[0]["probe"]
    assert sorted({r["stage"] for r in rows}) == [0, 1, 2, 3]
    for r in rows:
        for key in gq.metric_keys(r):
            if key.startswith(("cos_petra", "cos_delayed", "norm_")):
                assert r[key] == pytest.approx(1, abs=1e-2), (r, key)


def test_plot_and_table(tmp_path):
    rows = [{"step": s, "stage": j, "micro_batch": s, "samples": s, "reconstruction_error": 0.1 * j,
             **{f"{kind}_{a}_{b}": 0.5 + 0.1 * j for kind in ("cos", "norm") for a, b in gq.PAIRS}}
            for s in (0, 10) for j in range(3)]
    path = gq.plot(rows, str(tmp_path / "gq.png"))
    assert (tmp_path / "gq.png").stat().st_size > 1000 and path.endswith("gq.png")
    table = gq.by_stage(rows, first_step=0, last_step=10)
    assert [r["stage"] for r in table] == [0, 1, 2]
    assert table[2]["cos_petra_e2e"] == pytest.approx(0.7)
    assert not math.isnan(table[0]["reconstruction_error"])


def test_update_cosines_follow_the_updates_a_stage_takes():
    """cos_update_prev is the mean cosine of consecutive updates since the stage's last record; the
    update cosines against -g_e2e and -g_petra use the latest update."""
    from types import SimpleNamespace

    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    engine = SimpleNamespace(stages={3: SimpleNamespace(params=[w])}, num_petra_stages=4)
    probe = gq.GradientQuality(engine, every=1)
    assert math.isnan(probe.update_cosines(3, {"e2e": [torch.ones(2)]})["cos_update_e2e"])
    for update in ([1.0, 0.0], [1.0, 1.0], [-1.0, 0.0]):
        probe.before_step(engine, 3, 0)
        with torch.no_grad():
            w.add_(torch.tensor(update, dtype=torch.float64))
        probe.after_step(engine, 3, 0)
    record = probe.update_cosines(3, {"e2e": [torch.tensor([1.0, 0.0])], "petra": [torch.tensor([0.0, 1.0])]})
    assert record["cos_update_prev"] == pytest.approx((math.sqrt(0.5) - math.sqrt(0.5)) / 2)
    assert record["cos_update_e2e"] == pytest.approx(1.0)  # the latest update (-1, 0) descends along -(1, 0)
    assert record["cos_update_petra"] == pytest.approx(0.0)
    assert math.isnan(probe.update_cosines(3, {})["cos_update_prev"])  # consumed by the record

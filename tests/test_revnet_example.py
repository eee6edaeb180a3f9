"""examples/revnet/train.py for a few steps with two processes, PETRA and DeepSpeed's 1F1B."""

import json
import os
import sys

import pytest

from subprocess_env import ROOT


@pytest.mark.parametrize("config,method,stages,extra", [
    ("petra.json", "petra", 10, ["--gradient-quality", "2"]),
    # DeepSpeed's 1F1B path of the example: slow (the default run is near its 10-minute budget, and the
    # slow resume test trains this path twice over)
    pytest.param("backprop.json", "backprop", 2, [], marks=pytest.mark.slow)])
def test_two_process_run_writes_a_valid_summary(tmp_path, config, method, stages, extra):
    """Two pooled ranks run the example's main as the launcher's processes would (the ``deepspeed`` command itself:
    tests/test_launchers.py)."""
    from harness import launch, run_example

    out = tmp_path / "run"
    argv = ["--deepspeed_config", os.path.join(ROOT, "ds_configs", config), "--dataset", "digits", "--width", "8",
            "--epochs", "2", "--max-steps", "6", "--workers", "0", "--output-dir", str(out), *extra]
    launch({"example": "revnet", "argv": argv}, world_size=2, target=run_example)  # workers: test_example_resume
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and summary["stages"] == stages and summary["world_size"] == 2
    assert 0.0 <= summary["final_eval_acc"] <= 1.0 and summary["samples_per_s"] > 0
    assert summary["args"]["arch"] == "revnet18" and summary["recipe"]["milestones"] == [1, 2]
    all_rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in all_rows if "kind" not in r]
    assert [r["step"] for r in rows] == [5, 6]  # 22 micro-batches per epoch / k = 4 -> 5 steps per epoch
    assert (out / "curves.png").stat().st_size > 1000
    quality = [r for r in all_rows if r.get("kind") == "gradient_quality"]
    if extra:  # the first micro-batch of calls 1, 3, 5 followed through all 10 stages (drained at the end)
        assert sorted({(r["step"], r["micro_batch"]) for r in quality}) == [(0, 0), (2, 8), (4, 16)]
        assert sorted(r["stage"] for r in quality) == sorted(list(range(stages)) * 3)
        assert all(-1 <= r["cos_petra_e2e"] <= 1 and r["reconstruction_error"] >= 0 for r in quality)
        assert (out / "gradient_quality.png").stat().st_size > 1000
    else:
        assert quality == [] and not (out / "gradient_quality.png").exists()


def test_profile_partition_measures_once_and_every_rank_cuts_from_the_file(tmp_path):
    """--partition profile on two pooled ranks: rank 0's costs file is whole (one cost per layer, a
    reconstruction time exactly for the reversible middle layers) and the run's cut is the balanced cut
    of that file, recomputed here (PETRA's rule, petra.json's input buffer, J = --stages)."""
    from harness import launch, run_example
    from petra_ds.data import INFO
    from petra_ds.models.revnet import revnet_layers
    from petra_ds.pipeline.module import spec_is_reversible
    from petra_ds.pipeline.partition import balanced_parts, load_costs

    out = tmp_path / "run"
    argv = ["--deepspeed_config", os.path.join(ROOT, "ds_configs", "petra.json"), "--dataset", "digits", "--width", "8",
            "--epochs", "1", "--max-steps", "1", "--workers", "0", "--stages", "4", "--partition", "profile",
            "--output-dir", str(out)]
    launch({"example": "revnet", "argv": argv}, world_size=2, target=run_example)
    summary = json.loads((out / "summary.json").read_text())
    costs_file = out / "layer_costs.json"
    assert summary["partition"]["method"] == "profile" and summary["partition"]["layer_costs"] == str(costs_file)
    assert [p.name for p in out.iterdir() if p.name.startswith("layer_costs")] == ["layer_costs.json"]
    costs = load_costs(str(costs_file))
    specs = revnet_layers(18, INFO["digits"].num_classes, INFO["digits"].cifar_stem, 8)
    assert len(costs) == len(specs) == 10
    assert all(c.forward > 0 and c.forward_grad > 0 and c.backward > 0 for c in costs)
    assert [c.reconstruct is not None for c in costs] == [
        spec_is_reversible(s) and i < len(specs) - 1 for i, s in enumerate(specs)]
    assert summary["partition"]["parts"] == balanced_parts(costs, 4, "non_reversible", rule="petra")
    assert summary["stages"] == 4


@pytest.mark.parametrize("methods,gaps", [(["petra"], {}),
                                          (["backprop", "petra", "weight_prediction"],
                                           {"backprop - petra": 2.0, "weight_prediction - petra": 1.0})])
def test_the_accuracy_benchmark_reports_each_method_against_petra(tmp_path, monkeypatch, methods, gaps):
    """python -m benchmarks.accuracy with any subset of methods (a PETRA-only re-run included): each method's gap to PETRA
    in points of final accuracy, from the runs' summaries (the runs themselves replaced here)."""
    from subprocess_env import load_benchmark

    bench = load_benchmark("accuracy")
    accuracy = {"petra": 0.97, "backprop": 0.99, "weight_prediction": 0.98}

    def fake_run(cmd, out):
        method = os.path.basename(out)
        return {"final_eval_acc": accuracy[method], "best_eval_acc": accuracy[method], "samples_per_s": 1.0,
                "stages": 1}, [], 0.0

    monkeypatch.setattr(bench, "run_example", fake_run)
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--methods", *methods, "--output", str(tmp_path / "r.json")])
    bench.main()
    report = json.loads((tmp_path / "r.json").read_text())
    assert sorted(report["results"]) == sorted(methods)
    assert report["gaps_points_final"] == pytest.approx(gaps)
    assert report["gap_points_final"] == (pytest.approx(2.0) if "backprop" in methods else None)


def test_the_accuracy_benchmark_gives_every_method_the_same_split_of_the_global_batch(tmp_path, monkeypatch):
    from subprocess_env import load_benchmark

    bench = load_benchmark("accuracy")
    commands = {}

    def fake_run(cmd, out):
        commands[os.path.basename(out)] = cmd
        return {"final_eval_acc": 0.9, "best_eval_acc": 0.9, "samples_per_s": 1.0, "stages": 1}, [], 0.0

    monkeypatch.setattr(bench, "run_example", fake_run)
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--methods", "backprop", "petra", "--global-batch", "64",
                                      "--micro-batches", "8", "--output", str(tmp_path / "r.json")])
    bench.main()
    for cmd in commands.values():
        assert cmd[cmd.index("--global-batch") + 1] == "64" and cmd[cmd.index("--micro-batches") + 1] == "8"
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["global_batch"], report["micro_batches"]) == (64, 8)

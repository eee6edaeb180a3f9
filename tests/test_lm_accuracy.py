"""``python -m benchmarks.accuracy lm``'s recipes: the command a run gets for an optimizer and its delay
compensation."""

import argparse
import json
import os

import pytest

from benchmarks.lib import lm_accuracy as bench


def _args(**overrides):
    values = {"procs": 1, "petra_config": "ds_configs/petra_lm.json", "backprop_config": "ds_configs/backprop_lm.json",
              "seq_len": 64, "d_model": 128, "layers": 6, "heads": 4, "vocab_size": 2048, "warmup_frac": 0.05,
              "eval_every": 100, "eval_sequences": 120, "global_batch": 16, "gradient_quality": 0, "backprop_k": 4,
              "save_every": 0}
    return argparse.Namespace(**{**values, **overrides})


def _optimizer(cmd):
    return json.loads(cmd[cmd.index("--optimizer") + 1])


def test_muon10_sets_its_own_muon_lr_and_the_recipe_its_compensation():
    assert bench.recipe_parts("muon10+wp") == ("muon10", ["weight_prediction"])
    job = {"arm": "petra", "recipe": "muon10+wp", "lr": 2e-3, "J": 4, "k": 4, "seed": 0, "steps": 1500}
    cmd = bench.command(_args(), ["t.txt", "v.txt"], job, "out")
    section = _optimizer(cmd)
    assert section["type"] == "muon" and section["params"]["muon_lr"] == pytest.approx(0.02)
    assert cmd[cmd.index("--delay-compensation") + 1] == "weight_prediction" and cmd[cmd.index("--stages") + 1] == "4"
    # "muon" is 20x whatever the example's default ratio, so its cached runs keep their meaning
    plain = _optimizer(bench.command(_args(), ["t.txt", "v.txt"], {**job, "recipe": "muon", "arm": "backprop"}, "o"))
    assert plain["params"]["muon_lr"] == pytest.approx(0.04)
    averaged = bench.command(_args(), ["t.txt", "v.txt"], {**job, "recipe": "muon10+wpa"}, "o")
    assert json.loads(averaged[averaged.index("--delay-compensation") + 1]) == {"method": "weight_prediction",
                                                                              "beta": 0.5}
    lowered = bench.command(_args(), ["t.txt", "v.txt"], {**job, "recipe": "muon10+wph+aml"}, "o")
    assert json.loads(lowered[lowered.index("--delay-compensation") + 1]) == [
        {"method": "weight_prediction", "scale": 0.5}, {"method": "adaptive_momentum", "beta1_max": 0.8}]
    further = bench.command(_args(), ["t.txt", "v.txt"], {**job, "recipe": "muon10+wp15"}, "o")
    assert json.loads(further[further.index("--delay-compensation") + 1]) == {"method": "weight_prediction",
                                                                              "scale": 1.5}
    high = _optimizer(bench.command(_args(), ["t.txt", "v.txt"], {**job, "recipe": "muon10b95+wp"}, "o"))
    assert high["params"]["betas"] == [0.95, 0.95] and high["params"]["muon_lr"] == pytest.approx(0.02)
    with pytest.raises(SystemExit, match="unknown recipe"):
        bench.recipe_parts("muon5+wp")


def test_nc_turns_clipping_off_on_both_sides_and_pairs_petra_with_that_backprop(tmp_path):
    assert bench.recipe_parts("muon10+wp+nc") == ("muon10", ["weight_prediction"])
    assert bench.backprop_recipe("muon10+wp+nc") == "muon10+nc" and bench.backprop_recipe("muon10+wp") == "muon10"
    run_dir = str(tmp_path / "runs")
    job = {"arm": "petra", "recipe": "muon10+wp+nc", "lr": 2e-3, "J": 8, "k": 4, "seed": 0, "steps": 1500}
    for arm, shipped in (("petra", "ds_configs/petra_lm.json"), ("backprop", "ds_configs/backprop_lm.json")):
        cmd = bench.command(_args(run_dir=run_dir), ["t.txt", "v.txt"], {**job, "arm": arm}, "o")
        bench.write_config(_args(run_dir=run_dir), {**job, "arm": arm})
        config = cmd[cmd.index("--deepspeed_config") + 1]
        assert config != shipped
        with open(config) as f, open(os.path.join(bench.ROOT, shipped)) as g:
            assert json.load(f) == {**json.load(g), "gradient_clipping": 0}
    plain = bench.command(_args(run_dir=run_dir), ["t.txt", "v.txt"], {**job, "recipe": "muon10+wp"}, "o")
    assert plain[plain.index("--deepspeed_config") + 1] == "ds_configs/petra_lm.json"
    runs = [{"arm": "backprop", "recipe": "muon10", "lr": 2e-3, "J": None, "k": 4, "steps": 1500,
             "final_val_loss": 4.40},
            {"arm": "backprop", "recipe": "muon10+nc", "lr": 2e-3, "J": None, "k": 4, "steps": 1500,
             "final_val_loss": 4.50},
            {**job, "final_val_loss": 4.55}]
    (row,) = bench.best_against_best(runs)
    assert row["backprop_best"]["optimizer"] == "muon10"
    assert row["gap_to_best_backprop"] == pytest.approx(0.15 / 4.40)
    assert row["gap_to_own_optimizer"] == pytest.approx(0.05 / 4.50)


def test_f2_keeps_the_first_two_stages_inputs_on_petras_side_only(tmp_path):
    run_dir = str(tmp_path / "runs")
    job = {"arm": "petra", "recipe": "muon10+wp+f2+nc", "lr": 2e-3, "J": 16, "k": 30, "seed": 1, "steps": 1500}
    assert bench.recipe_parts(job["recipe"]) == ("muon10", ["weight_prediction"])
    assert bench.backprop_recipe(job["recipe"]) == "muon10+nc"
    bench.write_config(_args(run_dir=run_dir), job)
    cmd = bench.command(_args(run_dir=run_dir), ["t.txt", "v.txt"], job, "o")
    with open(cmd[cmd.index("--deepspeed_config") + 1]) as f, open(os.path.join(bench.ROOT,
                                                                                "ds_configs/petra_lm.json")) as g:
        shipped = json.load(g)
        assert json.load(f) == {**shipped, "gradient_clipping": 0,
                                "petra": {**shipped["petra"], "input_buffer": "first_2"}}
    assert bench.config_overrides(job["recipe"], "backprop") == {"gradient_clipping": 0}
    assert bench.RUN_NAME.match(bench.run_name(job))["recipe"] == job["recipe"]
    deep = {**job, "recipe": "muon10+wp+f8", "J": 32}
    assert bench.config_overrides(deep["recipe"]) == {"petra": {"input_buffer": "first_8"}}
    assert bench.config_overrides("muon10+wp+fa") == {"petra": {"input_buffer": "all"}}
    assert bench.RUN_NAME.match(bench.run_name(deep))["recipe"] == deep["recipe"]


def test_a_run_validated_on_other_sequences_is_compared_by_its_revalidated_loss_or_not_at_all():
    """Rows carry the loss of the final weights on the protocol's sequences; a run that could not be revalidated
    (final_val_loss None) is in no cell."""
    backprop = {"arm": "backprop", "recipe": "muon10", "lr": 2e-3, "J": None, "k": 4, "steps": 1500, "seed": 0,
                "final_val_loss": 4.40, "revalidated_from": None}
    k8 = {"arm": "petra", "recipe": "muon10+wp", "lr": 2e-3, "J": 8, "k": 8, "steps": 1500, "seed": 0,
          "final_val_loss": 4.44, "revalidated_from": 4.52}
    lost = {**k8, "k": 16, "final_val_loss": None, "revalidated_from": None}
    rows = bench.best_against_best([backprop, k8, lost])
    assert [(r["k"], r["revalidated"]) for r in rows] == [(8, True)]
    assert rows[0]["gap_to_best_backprop"] == pytest.approx(0.04 / 4.40)
    summary = {"args": {"eval_batches": 30}, "config": {"train_micro_batch_size_per_gpu": 2}}
    assert bench.validated_sequences(summary) == 60
    summary["args"]["eval_sequences"] = 120
    assert bench.validated_sequences(summary) == 120


def test_an_earlier_reports_runs_join_unless_the_report_has_them(tmp_path):
    """--earlier: a run read back from --run-dir wins over the earlier report's copy of the same run."""
    job = {"arm": "petra", "recipe": "muon10+wp", "lr": 2e-3, "J": 8, "k": 4, "seed": 0, "steps": 1500}
    gone = {**job, "final_val_loss": 4.50, "val_curve": [[100, 6.0], [1500, 4.50]]}
    kept = {**job, "seed": 1, "final_val_loss": 4.49, "val_curve": [[100, 6.1], [1500, 4.49]]}
    report = tmp_path / "earlier.json"
    report.write_text(json.dumps({"runs": [gone, kept]}))
    (carried,) = bench.earlier_runs(str(report), {bench.run_name(kept)})
    assert carried == gone


def _run(arm, recipe, lr, J, k, loss, seed=0, steps=1500):
    return {"arm": arm, "recipe": recipe, "lr": lr, "J": J, "k": k, "seed": seed, "steps": steps,
            "final_val_loss": loss, "val_curve": [(steps // 2, loss + 1), (steps, loss)], "revalidated_from": None}


def test_the_depth_table_reads_the_recommended_and_the_half_k_of_each_depth(tmp_path):
    """J = 16: the recommended k is 30, half of it 15. The shipped recipe is compared with backprop of its own
    optimizer, the best recipe with the best backprop of any optimizer; a screening length is not read."""
    from benchmarks.lib import lm_depth

    runs = [_run("backprop", "muon10", 2e-3, None, 2, 4.00), _run("backprop", "muon10", 2e-3, None, 2, 4.02, seed=1),
            _run("backprop", "adamw", 2e-3, None, 2, 3.90),
            _run("petra", "muon10+wp", 2e-3, 16, 30, 4.04), _run("petra", "muon10+wp", 2e-3, 16, 30, 4.06, seed=1),
            _run("petra", "muon10+ef", 2e-3, 16, 30, 4.03), _run("petra", "muon10+wp", 2e-3, 16, 15, 4.12),
            _run("petra", "muon10+wp", 2e-3, 16, 8, 4.50), _run("petra", "muon10+wp", 2e-3, 16, 30, 3.0, steps=100)]
    report = {"args": {"layers": 13, "d_model": 64, "backprop_k": 2}, "runs": runs,
              "best": bench.best_against_best(runs), "source": "r16.json"}
    rows = lm_depth.depth_rows(report)
    assert [(r["J"], r["k"], r["k_is"], r["steps"]) for r in rows] == [(16, 30, "recommended", 1500),
                                                                        (16, 15, "half", 1500)]
    recommended, half = rows
    assert recommended["shipped_gap"] == pytest.approx(4.05 / 4.01 - 1) and recommended["shipped_seeds"] == 2
    assert recommended["best_recipe"] == "muon10+ef" and recommended["best_gap"] == pytest.approx(4.03 / 3.90 - 1)
    assert half["shipped_gap"] == pytest.approx(4.12 / 4.01 - 1) and half["best_recipe"] == "muon10+wp"
    path = tmp_path / "r16.json"
    path.write_text(json.dumps({k: v for k, v in report.items() if k != "source"}))
    lm_depth.main(["--reports", str(path), "--output", str(tmp_path / "depth.json")])
    saved = json.loads((tmp_path / "depth.json").read_text())
    assert [r["k"] for r in saved["rows"]] == [30, 15] and (tmp_path / "depth.png").stat().st_size > 1000


def test_backprop_runs_follow_the_recipes_unless_named_and_none_when_the_flag_is_alone():
    def arms(named, recipes=("muon10+ef", "adamw+wp")):
        args = _args(recipes=list(recipes), backprop_optimizers=named, lrs=[2e-3], stages=[8], k=[4],
                     seeds=[0], steps=1500)
        return sorted((j["arm"], j["recipe"]) for j in bench.jobs(args))
    petra = [("petra", "adamw+wp"), ("petra", "muon10+ef")]
    assert arms(None) == sorted([("backprop", "adamw"), ("backprop", "muon10"), *petra])
    assert arms(["muon10"]) == sorted([("backprop", "muon10"), *petra])
    assert arms([]) == petra
    assert arms(["muon10"], recipes=()) == [("backprop", "muon10")]  # --recipes alone: backprop only


@pytest.mark.parametrize("flags, named", [(["--global-batch", "30", "--k", "30"], "--backprop-k 4"),
                                          (["--global-batch", "30", "--backprop-k", "2", "--k", "4"], "--k 4")])
def test_a_k_that_does_not_divide_the_global_batch_stops_before_any_run(flags, named, capsys, monkeypatch):
    monkeypatch.setattr(bench, "stdlib_corpus", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit):
        bench.main(flags)
    assert f"{named} does not divide --global-batch 30" in capsys.readouterr().err


def test_save_every_makes_a_run_checkpoint_and_continue_where_a_stopped_sitting_left_it():
    job = {"arm": "petra", "recipe": "muon10+wp", "lr": 2e-3, "J": 32, "k": 62, "seed": 0, "steps": 1500}
    once = bench.command(_args(), ["t.txt", "v.txt"], job, "o")
    assert "--save-every" not in once and "--resume" not in once
    sittings = bench.command(_args(save_every=50), ["t.txt", "v.txt"], job, "o")
    assert sittings[sittings.index("--save-every") + 1] == "50" and sittings[sittings.index("--resume") + 1] == "auto"
    at = sittings.index("--save-every")
    assert sittings[:at] + sittings[at + 4:] == once


def test_a_run_continued_from_a_checkpoint_reports_no_wall_time_of_one_sitting(tmp_path, monkeypatch):
    job = {"arm": "backprop", "recipe": "muon10", "lr": 2e-3, "J": None, "k": 4, "seed": 0, "steps": 100}
    args = _args(run_dir=str(tmp_path), save_every=50)
    summary = {"args": {"eval_sequences": 120}, "final_val_loss": 5.0}
    monkeypatch.setattr(bench, "run_example", lambda cmd, out, env=None: (summary, [{"val_loss": 5.0, "step": 100}],
                                                                           12.0))
    assert bench.run_one(args, ["t.txt", "v.txt"], job)["wall_s"] == 12.0
    checkpoints = os.path.join(bench.ROOT, args.run_dir, bench.run_name(job), "checkpoints")
    os.makedirs(checkpoints)  # made, but nothing saved in it yet: the run starts fresh
    assert bench.run_one(args, ["t.txt", "v.txt"], job)["wall_s"] == 12.0
    os.makedirs(os.path.join(checkpoints, "global_step50"))
    assert bench.run_one(args, ["t.txt", "v.txt"], job)["wall_s"] is None

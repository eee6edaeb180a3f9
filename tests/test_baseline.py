"""``--baseline DIR`` in both examples: a run's gap to another run, and whether the two share an optimizer, so that
a gap is the method's and not the optimizer's; the shipped pairs of configs train with the same optimizer."""

import json
import os

import pytest

from petra_ds.tools.runs import against_baseline, optimizer_identity
from subprocess_env import ROOT

MUON = {"type": "muon", "params": {"momentum": 0.95, "betas": [0.9, 0.95], "weight_decay": 0.01}}


def _config(name):
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        return json.load(f)


def _baseline(tmp_path, method, value, config, metric="final_val_loss"):
    (tmp_path / "summary.json").write_text(json.dumps({"method": method, metric: value, "config": config}))
    return str(tmp_path)


@pytest.mark.parametrize("petra,backprop", [("petra_lm.json", "backprop_lm.json"), ("petra.json", "backprop.json"),
                                            ("petra_digits.json", "backprop_digits.json")])
def test_each_shipped_pair_trains_both_sides_with_one_optimizer(petra, backprop):
    assert optimizer_identity(_config(petra)) == optimizer_identity(_config(backprop))


def test_the_same_optimizer_at_other_learning_rates_is_the_same_optimizer(tmp_path):
    theirs = {"optimizer": {**MUON, "params": {**MUON["params"], "lr": 2e-3, "muon_lr": 2e-2}}}
    mine = {"method": "petra", "final_val_loss": 4.2, "config": {"optimizer": {**MUON, "params": {
        **MUON["params"], "lr": 1e-3}}}}
    result = against_baseline(mine, _baseline(tmp_path, "backprop", 4.0, theirs), "final_val_loss")
    assert result["same_optimizer"] is True
    assert result["gap"] == pytest.approx(0.05) and result["gap_unit"] == "relative"
    assert result["label"] == ("petra final_val_loss 4.2000 against backprop 4.0000: +5.00%, the same optimizer "
                               "(muon)")


def test_another_optimizer_is_named_as_such(tmp_path):
    mine = {"method": "petra", "final_val_loss": 3.9, "config": {"optimizer": MUON}}
    result = against_baseline(mine, _baseline(tmp_path, "backprop", 4.0, {}), "final_val_loss")
    assert result["same_optimizer"] is False and result["gap"] == pytest.approx(-0.025)
    assert result["label"].endswith("another optimizer (the default AdamW for backprop)")
    other = {"optimizer": {**MUON, "params": {**MUON["params"], "momentum": 0.9}}}
    assert not against_baseline(mine, _baseline(tmp_path, "backprop", 4.0, other), "final_val_loss")["same_optimizer"]


def test_an_accuracy_gap_is_in_points_and_positive_when_worse(tmp_path):
    mine = {"method": "petra", "final_eval_acc": 0.9861, "config": {}}
    result = against_baseline(mine, _baseline(tmp_path, "backprop", 0.9944, {}, "final_eval_acc"), "final_eval_acc",
                              higher_is_better=True)
    assert result["gap"] == pytest.approx(0.83) and result["gap_unit"] == "points" and result["same_optimizer"]


def test_a_baseline_without_a_summary_is_refused_before_training(tmp_path):
    from harness import launch, run_example

    argv = ["--deepspeed_config", os.path.join(ROOT, "ds_configs", "petra_lm.json"), "--model", "revgpt",
            "--baseline", str(tmp_path / "nothing"), "--output-dir", str(tmp_path / "run")]
    ran = launch({"example": "reformer", "argv": argv, "return_error": True}, world_size=1, target=run_example)[0]
    assert "--baseline" in str(ran["error"]) and "no summary.json there" in str(ran["error"])

"""examples/revnet/train.py for a few steps with two processes, PETRA and DeepSpeed's 1F1B."""

import json
import os
import subprocess
import sys

import pytest

from petra_ds.launch import free_port
from subprocess_env import ROOT, launcher_env


@pytest.mark.parametrize("config,method,stages,extra", [
    ("petra.json", "petra", 10, ["--gradient-quality", "2"]),
    # DeepSpeed's 1F1B path of the example: slow (the default run is near its 10-minute budget, and the
    # slow resume test trains this path twice over)
    pytest.param("backprop.json", "backprop", 2, [], marks=pytest.mark.slow)])
def test_two_process_run_writes_a_valid_summary(tmp_path, config, method, stages, extra):
    out = tmp_path / "run"
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "revnet", "train.py"), "--deepspeed_config",
           os.path.join(ROOT, "ds_configs", config), "--dataset", "digits", "--width", "8", "--epochs", "2",
           "--max-steps", "6", "--workers", "1", "--output-dir", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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

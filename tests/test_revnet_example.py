"""examples/revnet/train.py for a few steps with two processes, PETRA and DeepSpeed's 1F1B."""

import json
import os
import subprocess
import sys

import pytest

from petra_ds.launch import free_port
from subprocess_env import ROOT, launcher_env


@pytest.mark.parametrize("config,method,stages", [("petra.json", "petra", 10), ("backprop.json", "backprop", 2)])
def test_two_process_run_writes_a_valid_summary(tmp_path, config, method, stages):
    out = tmp_path / "run"
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "revnet", "train.py"), "--deepspeed_config",
           os.path.join(ROOT, "ds_configs", config), "--dataset", "digits", "--width", "8", "--epochs", "2",
           "--max-steps", "6", "--workers", "1", "--output-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and summary["stages"] == stages and summary["world_size"] == 2
    assert 0.0 <= summary["final_eval_acc"] <= 1.0 and summary["samples_per_s"] > 0
    assert summary["args"]["arch"] == "revnet18" and summary["recipe"]["milestones"] == [1, 2]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 6]  # 22 micro-batches per epoch / k = 4 -> 5 steps per epoch
    assert (out / "curves.png").stat().st_size > 1000

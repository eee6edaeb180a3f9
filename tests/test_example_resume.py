"""``--save-every`` / ``--resume`` of the example scripts: a run stopped after its last checkpoint and resumed
ends where the uninterrupted run ends, for PETRA and for DeepSpeed's 1F1B; and the pieces that make it so
(the data stream's position, keyed augmentation, metrics.jsonl kept up to the checkpoint)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from petra_ds.data.stream import EpochBatches, KeyedSamples
from petra_ds.runtime.distributed import free_port
from petra_ds.tools.runs import RunFiles
from subprocess_env import ROOT, launcher_env

from test_lm_example import SMALL, _files


def test_the_stream_starting_at_micro_batch_n_is_the_tail_of_the_whole_stream():
    """10 samples, micro-batch 3: 3 batches per epoch (one sample dropped), a fresh order every epoch."""
    whole = iter(EpochBatches(10, 3, seed=5))
    head = [next(whole) for _ in range(8)]
    for start in (0, 2, 3, 7):
        tail = iter(EpochBatches(10, 3, seed=5, start=start))
        assert [next(tail) for _ in range(8 - start)] == head[start:]
    positions = [p for batch in head for _, p in batch]
    assert positions == list(range(24))
    epochs = [sorted(i for batch in head[e * 3:e * 3 + 3] for i, _ in batch) for e in range(2)]
    assert all(len(set(e)) == 9 for e in epochs) and head[0] != head[3]


@pytest.mark.parametrize("start", [0, 4])
def test_a_global_micro_batch_is_the_same_samples_on_any_number_of_replicas(start):
    """31 samples, global micro-batch 6: 5 per epoch, one sample dropped. Two replicas of 3 rows (and three of 2)
    read, from micro-batch ``start`` on, the rows of the one-replica stream in replica order, at the same stream
    positions: a run resumed on another data-parallel degree goes on with the same samples and augmentation."""
    one = iter(EpochBatches(31, 6, seed=2, start=start))
    for count in (2, 3):
        parts = [iter(EpochBatches(31, 6 // count, seed=2, start=start, part=(r, count))) for r in range(count)]
        whole = iter(EpochBatches(31, 6, seed=2, start=start))
        for _ in range(12):
            assert sum((next(p) for p in parts), []) == next(whole)
    assert [p for _, p in next(one)] == list(range(6 * start, 6 * start + 6))
    with pytest.raises(ValueError, match="replica 2 of 2"):
        EpochBatches(31, 3, seed=2, part=(2, 2))


class Noise(torch.utils.data.Dataset):
    """A sample's 'augmentation' is a draw from torch's global stream, as torchvision's transforms do."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return index + torch.rand(())


def test_augmentation_depends_on_the_stream_position_only():
    data = KeyedSamples(Noise(), seed=1)
    torch.manual_seed(0)
    first = data[(2, 17)]
    state = torch.get_rng_state()
    torch.manual_seed(123)  # whatever the global stream holds
    assert data[(2, 17)] == first and data[(2, 18)] != first
    torch.manual_seed(0)
    data[(2, 17)]
    assert torch.equal(torch.get_rng_state(), state), "the caller's stream is left as it was"


def test_metrics_are_kept_up_to_the_checkpoint_and_appended_on_resume(tmp_path):
    rows = [{"step": 2, "loss": 1.0}, {"step": 4, "loss": 0.5}, {"step": 6, "loss": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = RunFiles(str(tmp_path), enabled=True, resumed_at=5)  # step 6 came after the checkpoint: dropped
    assert files.kept_rows == rows[:2]
    no_monitor = SimpleNamespace(monitor=SimpleNamespace(enabled=False))
    files.log({"step": 6, "loss": 0.3}, no_monitor, events=[], echo=lambda line: None)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6]
    RunFiles(str(tmp_path), enabled=True)  # a fresh run starts the file afresh
    assert (tmp_path / "metrics.jsonl").read_text() == ""


TIMING = ("elapsed_s", "samples_per_s", "tokens_per_s")


def _launch(script: str, config: str, args: list[str], out, processes: int = 2) -> subprocess.CompletedProcess:
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(processes), "--master_port",
           str(free_port()), os.path.join(ROOT, "examples", script, "train.py"), "--deepspeed_config",
           os.path.join(ROOT, "ds_configs", config), *args, "--save-every", "2", "--output-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _rows(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def _layer_files(out, tag: str) -> dict:
    folder = out / "checkpoints" / tag
    return {p.name: torch.load(p, weights_only=False) for p in sorted(folder.glob("layer_*-model_states.pt"))}


def assert_resume_is_exact(tmp_path, script: str, config: str, args: list[str], final_key: str,
                           resume: tuple[str, ...] = ("--resume",), resume_on: int = 2) -> None:
    """6 train_batch calls on 2 processes, checkpoints every 2. The stopped run ends after step 5 (checkpoint at
    4, then a step and an evaluation row that are lost); the resumed one (``resume`` flags, on ``resume_on``
    processes) loads step 4 and trains to 6. Final layer weights (float32) and every metrics row but the timings
    equal the uninterrupted run's."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _launch(script, config, args, whole)
    stopped = _launch(script, config, [*args, "--stop-after", "5"], parts)
    assert "stopped after step 5 of 6" in stopped.stdout and not (parts / "summary.json").exists()
    assert (parts / "checkpoints" / "latest").read_text() == "global_step4"
    assert [r["step"] for r in _rows(parts)] == [5]
    resumed = _launch(script, config, [*args, *resume], parts, processes=resume_on)
    assert f"resumed from {parts / 'checkpoints' / 'global_step4'} (step 4)" in resumed.stdout
    assert _rows(parts) == _rows(whole) and [r["step"] for r in _rows(parts)] == [5, 6]
    ours, theirs = _layer_files(parts, "global_step6"), _layer_files(whole, "global_step6")
    assert ours.keys() == theirs.keys() and ours
    for name, state in ours.items():
        for key, tensor in state.items():
            assert torch.equal(tensor, theirs[name][key]), (name, key)
    summaries = [json.loads((out / "summary.json").read_text()) for out in (whole, parts)]
    assert summaries[0][final_key] == summaries[1][final_key]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["petra.json", "backprop.json"])
def test_revnet_example_resumes_exactly(tmp_path, config):
    args = ["--dataset", "digits", "--width", "8", "--epochs", "2", "--max-steps", "6", "--workers", "1"]
    assert_resume_is_exact(tmp_path, "revnet", config, args, "final_eval_acc")


@pytest.mark.slow
@pytest.mark.parametrize("config", ["petra_lm.json", "backprop_lm.json"])
def test_revgpt_example_with_dropout_resumes_exactly(tmp_path, config):
    """Dropout 0.1 and seed 3: 1F1B's masks come from the global stream that DeepSpeed reseeds from the
    module's forward counter, which the example saves with its checkpoints."""
    small = dict(zip(SMALL[::2], SMALL[1::2]), **{"--max-steps": "6", "--eval-every": "5"})
    args = ["--model", "revgpt", "--tie-embeddings", "--seed", "3", "--stages", "4", "--data-files",
            *_files(tmp_path), *[x for kv in small.items() for x in kv]]
    assert_resume_is_exact(tmp_path, "reformer", config, args, "final_val_loss")


@pytest.mark.slow
def test_the_lm_example_stopped_on_two_processes_continues_on_one(tmp_path):
    """--resume auto after a relaunch on fewer processes: the same J = 4 stages, now all on one rank (1 x 4
    instead of 2 x 2), continue from the newest checkpoint and end where the uninterrupted 2-process run ends."""
    small = dict(zip(SMALL[::2], SMALL[1::2]), **{"--max-steps": "6", "--eval-every": "5"})
    args = ["--model", "revgpt", "--tie-embeddings", "--seed", "3", "--stages", "4", "--data-files",
            *_files(tmp_path), *[x for kv in small.items() for x in kv]]
    assert_resume_is_exact(tmp_path, "reformer", "petra_lm.json", args, "final_val_loss", resume=("--resume", "auto"),
                           resume_on=1)


@pytest.mark.slow
def test_the_lm_example_on_two_replicas_continues_as_one(tmp_path):
    """--resume auto after a relaunch on half the processes: J = 2 stages on one pipeline rank, 2 data-parallel
    replicas of micro-batch 2 (--global-batch 8 --micro-batches 2), continue from the newest checkpoint as 1
    replica of micro-batch 4 reading the same samples and drawing the same dropout masks (RevGPT's attention and
    residual dropout, by the two replicas' row blocks). SGD (Adam would divide float32 rounding by a near-zero
    second moment): the layer weights at the end equal the uninterrupted two-replica run's to float32
    reduction-order rounding, and so do the training losses."""
    small = dict(zip(SMALL[::2], SMALL[1::2]), **{"--max-steps": "6", "--eval-every": "5"})
    args = ["--model", "revgpt", "--dropout", "0.1", "--seed", "3", "--stages", "2", "--global-batch", "8",
            "--micro-batches", "2", "--optimizer", json.dumps({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}),
            "--data-files", *_files(tmp_path), *[x for kv in small.items() for x in kv]]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _launch("reformer", "petra_lm.json", [*args, "--data-parallel", "2"], whole)
    _launch("reformer", "petra_lm.json", [*args, "--data-parallel", "2", "--stop-after", "5"], parts)
    resumed = _launch("reformer", "petra_lm.json", [*args, "--resume", "auto"], parts, processes=1)
    assert f"resumed from {parts / 'checkpoints' / 'global_step4'} (step 4)" in resumed.stdout
    assert "1 data-parallel replica" in resumed.stdout, resumed.stdout[-2000:]
    losses = [[r["train_loss"] for r in _rows(out)] for out in (whole, parts)]  # val_loss: each replica its share
    assert len(losses[0]) == len(losses[1]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    ours, theirs = _layer_files(parts, "global_step6"), _layer_files(whole, "global_step6")
    assert ours.keys() == theirs.keys() and ours
    for name, state in ours.items():
        for key, tensor in state.items():
            if tensor.is_floating_point():
                assert (tensor - theirs[name][key]).abs().max() <= 1e-5 * theirs[name][key].abs().max(), (name, key)

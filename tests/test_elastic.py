"""A job that loses a rank continues by itself: under torchrun's elastic agent (--max-restarts) the LM
example with ``--save-every N --resume auto`` is SIGKILLed twice, once at a random moment and once while it
writes a checkpoint; the agent restarts the workers, they resume from the newest whole checkpoint, and the
run ends with the float32 weights and metrics of a run that was never interrupted. And a damaged newest
checkpoint: ``--resume auto`` falls back to the one before and loses nothing else."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from subprocess_env import ROOT, launcher_env
from test_example_resume import _launch, _layer_files, _rows
from test_lm_example import SMALL, _files

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def lm_args(tmp_path, steps: int, every: int = 2) -> list[str]:
    small = dict(zip(SMALL[::2], SMALL[1::2]), **{"--max-steps": str(steps), "--eval-every": str(every)})
    return ["--model", "revgpt", "--seed", "3", "--stages", "4", "--data-files", *_files(tmp_path),
            *[x for kv in small.items() for x in kv]]


def torchrun(args: list[str], out, restarts: int, every: int, procs: int = 2, log: str = "") -> subprocess.Popen:
    """The LM example under torchrun's agent on ``procs`` processes; its output goes to ``<out><log>.log`` (a pipe
    nobody reads while the test watches the run would fill and stop the workers)."""
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(procs), "--max-restarts", str(restarts),
           os.path.join(ROOT, "examples", "reformer", "train.py"), "--deepspeed_config",
           os.path.join(ROOT, "ds_configs", "petra_lm.json"), *args, "--save-every", str(every), "--resume", "auto",
           "--output-dir", str(out)]
    env = dict(launcher_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # as the README says: a store per attempt
    with open(f"{out}{log}.log", "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def workers(agent: int) -> list[int]:
    """The agent's worker processes (its children running the example)."""
    found = []
    for task in os.listdir(f"/proc/{agent}/task"):
        try:
            with open(f"/proc/{agent}/task/{task}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except OSError:
            continue
        for pid in children:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"train.py" in f.read():
                        found.append(pid)
            except OSError:
                continue
    return found


def saving(ckpt, since: float) -> list[str]:
    """The checkpoints being written now: PETRA writes each into a hidden ``.<tag>.partial`` folder first,
    made afresh for every save (one made before ``since`` is a killed save's leftover)."""
    try:
        names = os.listdir(ckpt)
    except FileNotFoundError:
        return []
    fresh = []
    for name in names:
        try:
            if name.endswith(".partial") and os.stat(ckpt / name).st_mtime > since:
                fresh.append(name)
        except FileNotFoundError:  # committed while we looked
            continue
    return fresh


def kill_twice(proc: subprocess.Popen, out, rng: random.Random) -> list[str]:
    """SIGKILL one worker once the first checkpoint exists plus a random delay, then one while a checkpoint
    is being written; what was killed, and when."""
    ckpt, kills = out / "checkpoints", []
    while proc.poll() is None and not (ckpt / "latest").exists():
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.0))
    victims = workers(proc.pid)
    if proc.poll() is None and victims:
        victim = rng.choice(victims)
        kills.append(f"pid {victim} at a random moment after {(ckpt / 'latest').read_text()}")
        os.kill(victim, signal.SIGKILL)
    time.sleep(5)  # the agent sees the death, stops the other worker and starts two new ones
    since = time.time()
    while proc.poll() is None:
        partial = saving(ckpt, since)
        victims = workers(proc.pid) if partial else []
        if victims:
            os.kill(rng.choice(victims), signal.SIGKILL)
            kills.append(f"while writing {partial}")
            break
        time.sleep(0.0005)
    return kills


@pytest.mark.slow
def test_a_killed_rank_is_restarted_by_torchrun_and_the_run_ends_as_if_never_killed(tmp_path):
    steps, every = 40, 4
    whole, elastic = tmp_path / "whole", tmp_path / "elastic"
    ref = torchrun(lm_args(tmp_path, steps, every), whole, restarts=0, every=every)
    assert ref.wait(timeout=600) == 0, open(f"{whole}.log").read()[-3000:]
    proc = torchrun(lm_args(tmp_path, steps, every), elastic, restarts=3, every=every)
    kills = kill_twice(proc, elastic, random.Random(int(time.time())))
    proc.wait(timeout=900)
    log = open(f"{elastic}.log").read()
    assert proc.returncode == 0, log[-4000:]
    assert len(kills) == 2 and "while writing" in kills[1], (kills, log[-3000:])
    print("kills:", kills)
    assert log.count("resumed from") >= 2, log[-3000:]
    assert _rows(elastic) == _rows(whole) and [r["step"] for r in _rows(whole)] == list(range(every, steps + 1, every))
    ours, theirs = _layer_files(elastic, f"global_step{steps}"), _layer_files(whole, f"global_step{steps}")
    assert ours.keys() == theirs.keys() and ours
    for name, state in ours.items():
        for key, tensor in state.items():
            assert torch.equal(tensor, theirs[name][key]), (name, key)
    final = [json.loads((out / "summary.json").read_text())["final_val_loss"] for out in (whole, elastic)]
    assert final[0] == final[1]


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_and_loses_nothing_else(tmp_path):
    """Checkpoints at 2 and 4, the run stopped after 5; global_step4's layer file truncated: --resume auto
    continues from 2 and ends as the uninterrupted run (the rows after 2 written again)."""
    args = lm_args(tmp_path, 6)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _launch("reformer", "petra_lm.json", args, whole)
    _launch("reformer", "petra_lm.json", [*args, "--stop-after", "5"], parts)
    victim = parts / "checkpoints" / "global_step4" / "layer_00-model_states.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    resumed = _launch("reformer", "petra_lm.json", [*args, "--resume", "auto"], parts)
    assert f"{victim} is truncated or corrupted" in resumed.stdout
    assert f"resumed from {parts / 'checkpoints' / 'global_step2'} (step 2)" in resumed.stdout
    assert _rows(parts) == _rows(whole)
    ours, theirs = _layer_files(parts, "global_step6"), _layer_files(whole, "global_step6")
    for name, state in ours.items():
        for key, tensor in state.items():
            assert torch.equal(tensor, theirs[name][key]), (name, key)


def assert_ends_as(out, whole, steps: int) -> None:
    """The metrics rows but the timings, and the final float32 layer weights, of the uninterrupted run."""
    assert _rows(out) == _rows(whole)
    ours, theirs = _layer_files(out, f"global_step{steps}"), _layer_files(whole, f"global_step{steps}")
    assert ours.keys() == theirs.keys() and ours
    for name, state in ours.items():
        for key, tensor in state.items():
            assert torch.equal(tensor, theirs[name][key]), (name, key)


@pytest.mark.slow
def test_a_job_that_lost_a_worker_continues_on_fewer_processes(tmp_path):
    """Two workers under torchrun with no restart left; one is SIGKILLed at a random moment after the first
    checkpoint, which ends the job. Relaunched with ``--nproc_per_node 1`` and ``--resume auto``, the same J = 4
    stages (now 1 x 4 instead of 2 x 2) continue from the newest checkpoint and end as the uninterrupted run."""
    steps, every = 16, 4
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ref = torchrun(lm_args(tmp_path, steps, every), whole, restarts=0, every=every)
    assert ref.wait(timeout=600) == 0, open(f"{whole}.log").read()[-3000:]
    proc = torchrun(lm_args(tmp_path, steps, every), parts, restarts=0, every=every)
    ckpt = parts / "checkpoints"
    while proc.poll() is None and not (ckpt / "latest").exists():
        time.sleep(0.05)
    time.sleep(random.Random(int(time.time())).uniform(0.0, 1.0))
    victims = workers(proc.pid)
    assert proc.poll() is None and victims, "the run ended before a worker could be killed"
    os.kill(victims[0], signal.SIGKILL)
    assert proc.wait(timeout=300) != 0  # no restart left: the agent ends the job
    newest = (ckpt / "latest").read_text()
    again = torchrun(lm_args(tmp_path, steps, every), parts, restarts=0, every=every, procs=1, log="_again")
    assert again.wait(timeout=600) == 0, open(f"{parts}_again.log").read()[-3000:]
    log = open(f"{parts}_again.log").read()
    assert "world_size=1" in log or '"world_size": 1' in log or "processes: 1 " in log, log[-3000:]
    assert f"resumed from {ckpt / newest}" in log, (newest, log[-3000:])
    assert_ends_as(parts, whole, steps)

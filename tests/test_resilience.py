"""A rank that dies mid-training or mid-save: its peers fail fast and loudly, and training restarts from the
last complete checkpoint to the same parameters, bit for bit, as a run that never stopped (float64, CPU)."""

import json
import os
import random
import re
import signal

import pytest
import torch

from petra_ds.runtime import checkpoint

from harness import launch, merged_params, run_processes
from test_engine import SGD, run as engine_run

#: test_engine's resume test trains this too: in a full run its uninterrupted result is already cached.
#: J = 4 stages, k = 2: clocks 0-9 train (5 train_batch calls), 10-15 drain.
COMMON = dict(k=2, train_batches=5, optimizer=SGD, dropout=0.1, petra={"input_buffer": "non_reversible"})
SAVE_EVERY = 2
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Timed out waiting")
#: the engine's own message around the backend's error: who, where, what to do
OUR_MESSAGE = re.compile(r"PeerLostError: rank \d+ \(PETRA stages \[[\d, ]+\]\) lost a peer during .+ at clock \d+: "
                         r"another rank died or stopped answering .*Restart every rank from the last checkpoint", re.S)


def uninterrupted(pipe: int = 2, stages_per_rank: int = 2) -> dict:
    """Final parameters of the run that never stopped (launched once per layout)."""
    return merged_params(engine_run(pipe, stages_per_rank, **COMMON))


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and bool(a) and all(torch.equal(a[n], b[n]) for n in a)


def killed_run(spec: dict, kill_record: str, grace: float = 60) -> tuple[list[dict], dict]:
    """Launch ``spec`` (which stops one rank) with ``grace`` seconds, after the first failure, for the
    others to exit; return every rank's outcome and what the dying rank noted."""
    outcomes = run_processes({**COMMON, "save_dir": os.path.dirname(kill_record) + "/ckpt",
                              "save_every": SAVE_EVERY, **spec, "kill_record": kill_record}, timeout=240, grace=grace)
    with open(kill_record) as f:
        return outcomes, json.load(f)


def assert_peers_failed_fast(outcomes: list[dict], stopped: int, kill: dict, within: float) -> list[float]:
    """Every rank but ``stopped`` exited non-zero with a lost-peer error within ``within`` seconds."""
    delays = []
    for o in outcomes:
        if o["rank"] == stopped:
            continue
        assert o["exitcode"] is not None, f"rank {o['rank']} still running {within} s after rank {stopped} stopped"
        assert o["exitcode"] != 0 and "error" in o, f"rank {o['rank']} exited {o['exitcode']}"
        assert PEER_LOST.search(o["error"]), o["error"][-2000:]
        assert OUR_MESSAGE.search(o["error"]), o["error"][-2000:]
        delays.append(round(o["ended"] - kill["time"], 2))
    assert max(delays) < within, delays
    print(f"the other ranks exited {delays} s after rank {stopped} stopped ({kill['what']})")
    return delays


def resume_to_the_end(ckpt, pipe: int = 2, stages_per_rank: int = 2) -> dict:
    """Fresh processes load ``latest`` from ``ckpt`` and train to the end, saving as before."""
    return merged_params(launch({**COMMON, "pipe": pipe, "stages_per_rank": stages_per_rank, "load_dir": str(ckpt),
                                 "save_dir": str(ckpt), "save_every": SAVE_EVERY}))


def random_kill(seed: int, world: int) -> tuple[int, int]:
    """(rank, clock) from ``random`` with ``seed`` ($PETRA_KILL_SEED overrides it), printed to rerun a failure."""
    seed = int(os.environ.get("PETRA_KILL_SEED", seed))
    rng = random.Random(seed)
    rank, clock = rng.randrange(world), rng.randrange(4, 16)  # the first checkpoint is written before clock 4
    print(f"random seed {seed} (PETRA_KILL_SEED): rank {rank} dies at the end of clock {clock}")
    return rank, clock


def latest_tag_after_kill_at(clock: int) -> str:
    steps_done = min(clock // COMMON["k"], COMMON["train_batches"])
    return f"global_step{steps_done // SAVE_EVERY * SAVE_EVERY}"


def kill_then_resume_exactly(tmp_path, seed: int, pipe: int, stages_per_rank: int) -> None:
    """SIGKILL one of ``pipe`` ranks at a clock drawn from ``seed``; its peers fail fast, ``latest`` is the
    last checkpoint before the kill, and resuming from it ends bitwise equal to the uninterrupted run."""
    kill_rank, kill_clock = random_kill(seed, world=pipe)
    outcomes, kill = killed_run({"pipe": pipe, "stages_per_rank": stages_per_rank, "kill_rank": kill_rank,
                                 "kill_at_clock": kill_clock}, str(tmp_path / "kill.json"))
    assert outcomes[kill_rank]["exitcode"] == -signal.SIGKILL
    assert_peers_failed_fast(outcomes, kill_rank, kill, within=60)
    assert checkpoint.resolve(str(tmp_path / "ckpt"), None)[0] == latest_tag_after_kill_at(kill_clock)
    assert same_bits(resume_to_the_end(tmp_path / "ckpt", pipe, stages_per_rank), uninterrupted(pipe, stages_per_rank))


def test_a_killed_rank_stops_its_peers_and_training_resumes_exactly(tmp_path):
    """A rank SIGKILLs itself at a random clock: the other rank raises a lost-peer error within 60 s (no
    hang); fresh processes restart from ``latest`` and end with the uninterrupted run's parameters, bitwise."""
    kill_then_resume_exactly(tmp_path, seed=20251121, pipe=2, stages_per_rank=2)


@pytest.mark.slow
def test_a_killed_rank_among_four_stops_them_all_and_training_resumes_exactly(tmp_path):
    """Four ranks, one stage each: the failure reaches the ranks that never talk to the dead one too."""
    kill_then_resume_exactly(tmp_path, seed=7, pipe=4, stages_per_rank=1)


@pytest.mark.slow
def test_a_hung_rank_stops_its_peers_after_the_configured_timeout(tmp_path):
    """A rank that stops answering without dying (SIGSTOP) at the end of a train_batch window, where the
    others wait in the loss broadcast on the pipeline group: they fail after ``init_distributed(timeout=)``
    (5 s here), not after torch's 30-minute default for groups created after the world group."""
    outcomes, kill = killed_run({"pipe": 2, "stages_per_rank": 2, "kill_rank": 1, "kill_at_clock": 7,
                                 "kill_signal": "SIGSTOP", "dist_timeout": 5}, str(tmp_path / "kill.json"), grace=2)
    delays = assert_peers_failed_fast(outcomes, 1, kill, within=30)
    assert "Timed out waiting 5000ms" in outcomes[0]["error"] and "_reduce_loss" in outcomes[0]["error"]
    assert min(delays) >= 4.5


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_a_rank_killed_while_writing_a_checkpoint_leaves_the_previous_one_loadable(tmp_path, async_save):
    """Rank 1 dies with half of its first PETRA stage file written in the second save (by its save's thread with
    ``async_save``): rank 0 fails at the save's barrier (or in the next clock's messages), ``latest`` still names
    the first checkpoint, and resuming from it reaches the same parameters."""
    ckpt = tmp_path / "ckpt"
    petra = {**COMMON["petra"], "async_save": async_save}
    outcomes, kill = killed_run({"pipe": 2, "stages_per_rank": 2, "kill_rank": 1, "petra": petra,
                                 "kill_in_save": {"save": 2, "at": "state"}}, str(tmp_path / "kill.json"))
    assert_peers_failed_fast(outcomes, 1, kill, within=60)
    assert kill["what"] == "writing petra_stage-02-data_00.pt"  # rank 1's first stage
    torn = list((ckpt / ".global_step4.partial").glob("petra_stage-02-data_00.pt.tmp-*"))
    assert len(torn) == 1 and torn[0].stat().st_size > 0
    assert (ckpt / "latest").read_text() == "global_step2" and not (ckpt / "global_step4").exists()
    assert checkpoint.resolve(str(ckpt), None) == ("global_step2", str(ckpt / "global_step2"))
    assert same_bits(resume_to_the_end(ckpt), uninterrupted())


@pytest.mark.slow
def test_rank_0_killed_between_the_renames_of_commit_resumes_from_the_previous_checkpoint(tmp_path):
    """Rank 0 dies after renaming the second checkpoint into place, before rewriting ``latest``: the run
    resumes from the first one and, saving the second again over the complete one, still ends exactly."""
    ckpt = tmp_path / "ckpt"
    outcomes, kill = killed_run({"pipe": 2, "stages_per_rank": 2, "kill_rank": 0,
                                 "kill_in_save": {"save": 2, "at": "commit:2"}}, str(tmp_path / "kill.json"))
    assert_peers_failed_fast(outcomes, 0, kill, within=60)
    assert (ckpt / "global_step4").is_dir() and (ckpt / "latest").read_text() == "global_step2"
    assert same_bits(resume_to_the_end(ckpt), uninterrupted())
    assert (ckpt / "latest").read_text() == "global_step4"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("latest.tmp-")) == [
        "global_step2", "global_step4", "latest"]  # the dead process's temporary stays, unread


# --- the windows of checkpoint.commit, simulated in this process ---


class Crash(Exception):
    """Stands for the process dying at this point."""


def _save(save_dir: str, tag: str, version: str, crash_at_replace: int | None = None, monkeypatch=None) -> None:
    """What rank 0 does for one save: a fresh partial directory with two files, then ``commit``; with
    ``crash_at_replace`` the process 'dies' instead of doing that ``os.replace`` (1-based)."""
    path = checkpoint.prepare(save_dir, tag)
    for name in ("layer_00-model_states.pt", "petra_stage-00-data_00.pt"):
        checkpoint.atomic_save({"version": version}, os.path.join(path, name))
    if crash_at_replace is None:
        checkpoint.commit(save_dir, tag, save_latest=True)
        return
    calls = iter(range(1, 100))
    replace = os.replace

    def dying_replace(src, dst):
        if next(calls) == crash_at_replace:
            raise Crash(f"before os.replace({src}, {dst})")
        replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", dying_replace)
        with pytest.raises(Crash):
            checkpoint.commit(save_dir, tag, save_latest=True)


def _loaded_version(save_dir: str) -> str:
    """The version ``latest`` leads to; both files of that directory must agree (a complete checkpoint)."""
    _, path = checkpoint.resolve(save_dir, None)
    versions = {torch.load(os.path.join(path, name))["version"] for name in sorted(os.listdir(path))}
    assert len(versions) == 1 and len(os.listdir(path)) == 2, (path, os.listdir(path))
    return versions.pop()


@pytest.mark.parametrize("crash_at_replace", [1, 2, 3])
def test_a_crash_inside_commit_of_the_same_tag_leaves_a_complete_checkpoint(tmp_path, crash_at_replace, monkeypatch):
    """Re-saving tag "last": commit moves the old directory aside (replace 1), renames the partial one into
    place (2) and rewrites ``latest`` (3); dying before any of them loads the old or the new version, whole."""
    save_dir = str(tmp_path)
    _save(save_dir, "last", "old")
    _save(save_dir, "last", "new", crash_at_replace, monkeypatch)
    assert _loaded_version(save_dir) == ("old" if crash_at_replace <= 2 else "new")
    _save(save_dir, "last", "newer")  # the next save cleans up after the crash
    assert _loaded_version(save_dir) == "newer"
    assert sorted(os.listdir(save_dir)) == ["last", "latest"]


@pytest.mark.parametrize("crash_at_replace", [1, 2])
def test_a_crash_inside_commit_of_a_new_tag_leaves_latest_on_the_previous_one(tmp_path, crash_at_replace, monkeypatch):
    """A new tag: the partial directory is renamed into place (replace 1), then ``latest`` (2)."""
    save_dir = str(tmp_path)
    _save(save_dir, "global_step2", "step2")
    _save(save_dir, "global_step4", "step4", crash_at_replace, monkeypatch)
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert _loaded_version(save_dir) == "step2"


@pytest.mark.parametrize("second_crash_at_replace", [1, 2, 3, 4])
def test_two_crashes_in_a_row_never_lose_the_only_copy(tmp_path, monkeypatch, second_crash_at_replace):
    """The first crash leaves tag "last" only as its moved-aside copy; the next run loads that copy, saves
    "last" again and dies inside commit (which first puts the aside copy back, replace 1): whatever the
    window, a complete "last" is still there to load."""
    save_dir = str(tmp_path)
    _save(save_dir, "last", "old")
    _save(save_dir, "last", "new", 2, monkeypatch)  # "last" moved aside, the new one not yet in place
    assert _loaded_version(save_dir) == "old"
    _save(save_dir, "last", "newer", second_crash_at_replace, monkeypatch)
    assert _loaded_version(save_dir) == ("old" if second_crash_at_replace <= 3 else "newer")


def test_a_crash_while_rewriting_latest_keeps_the_old_latest(tmp_path, monkeypatch):
    """``latest`` goes through a temporary file: a process dying after writing it, before its rename,
    leaves the old ``latest`` and a stray temporary that nothing reads."""
    save_dir = str(tmp_path)
    _save(save_dir, "global_step2", "step2")
    _save(save_dir, "global_step4", "step4", 2, monkeypatch)
    assert [p.name for p in tmp_path.glob("latest.tmp-*")] == [f"latest.tmp-{os.getpid()}"]
    assert _loaded_version(save_dir) == "step2"

"""``"petra": {"async_save": true}``: a checkpoint copied to host memory and written by a thread while training
goes on, committed by rank 0 once every rank has written; the same files, the same resume, bit for bit."""

import os

import torch

from harness import launch, merged_params
from petra_ds.runtime import background_save, checkpoint

SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
COMMON = {"pipe": 2, "stages_per_rank": 2, "k": 2, "train_batches": 5, "optimizer": SGD, "dropout": 0.1}


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and bool(a) and all(torch.equal(a[n], b[n]) for n in a)


def test_a_background_checkpoint_trains_and_resumes_as_a_synchronous_one(tmp_path):
    """Saves every 2 calls on 2 ranks, written in the background: the run's parameters equal the synchronous run's,
    the files hold the same tensors, and a resume from the newest one ends bit for bit where the run ended."""
    runs = {}
    for mode in ("sync", "async"):
        ckpt = str(tmp_path / mode)
        runs[mode] = launch({**COMMON, "petra": {"async_save": mode == "async"}, "save_dir": ckpt, "save_every": 2})
    assert same_bits(merged_params(runs["async"]), merged_params(runs["sync"]))
    for mode in ("sync", "async"):
        ckpt = tmp_path / mode
        assert (ckpt / "latest").read_text() == "global_step4"
        assert sorted(os.listdir(ckpt)) == ["global_step2", "global_step4", "latest"]  # no partial directory left
    files = sorted(os.listdir(tmp_path / "sync" / "global_step4"))
    assert sorted(os.listdir(tmp_path / "async" / "global_step4")) == files  # no marker left behind
    for name in files:
        ours = torch.load(tmp_path / "async" / "global_step4" / name, weights_only=True)
        theirs = torch.load(tmp_path / "sync" / "global_step4" / name, weights_only=True)
        assert _equal(ours, theirs), name
    resumed = launch({**COMMON, "load_dir": str(tmp_path / "async")})
    assert same_bits(merged_params(resumed), merged_params(runs["sync"]))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_rank_0_commits_only_once_every_rank_has_written(tmp_path):
    """Rank 0's poll leaves the checkpoint partial while rank 1's files are not written, commits once they are,
    and commits once; the markers do not reach the checkpoint."""
    save_dir, tag = str(tmp_path), "global_step1"
    partial = checkpoint.prepare(save_dir, tag)
    commits = []

    def commit() -> str:
        commits.append(tag)
        return checkpoint.commit(save_dir, tag, save_latest=True)

    rank0 = background_save.BackgroundSave([(os.path.join(partial, "a.pt"), {"w": torch.ones(3)})], partial, 0, 2,
                                           commit)
    rank0.wait_written()
    rank0.poll()
    assert commits == [] and os.path.isdir(partial) and not (tmp_path / "latest").exists()
    rank1 = background_save.BackgroundSave([(os.path.join(partial, "b.pt"), {"w": torch.zeros(2)})], partial, 1, 2,
                                           None)
    rank1.wait_written()
    rank0.poll()
    rank0.poll()
    assert commits == [tag] and (tmp_path / "latest").read_text() == tag
    assert sorted(os.listdir(tmp_path / tag)) == ["a.pt", "b.pt"]


def test_a_failed_background_write_is_raised_in_the_training_thread(tmp_path):
    missing = str(tmp_path / "no-such-directory")
    failed = background_save.BackgroundSave([(os.path.join(missing, "a.pt"), {"w": torch.ones(1)})], missing, 0, 1,
                                            lambda: "")
    try:
        failed.wait_written()
    except RuntimeError as error:
        assert f"the background checkpoint write into {missing} failed on rank 0" in str(error)
    else:
        raise AssertionError("the write's failure was not raised")


def test_the_snapshot_is_a_copy_taken_at_the_save_into_memory_kept_for_the_next():
    """What the thread writes is what the state was at the save: later in-place updates do not reach it. The next
    save of the same shapes copies into the same host memory; another shape gets its own."""
    weights, moments = torch.ones(4), [torch.zeros(2), {"step": torch.tensor(3.0)}]
    state = {"weights": weights, "optimizer": moments, "clock": 7}
    staging = background_save.HostStaging()
    host = staging.copy(state)
    weights.add_(1.0)
    moments[1]["step"].add_(1.0)
    assert torch.equal(host["weights"], torch.ones(4)) and host["optimizer"][1]["step"].item() == 3.0
    assert host["clock"] == 7 and isinstance(host["optimizer"], list)
    again = staging.copy(state)
    assert again["weights"].data_ptr() == host["weights"].data_ptr() and torch.equal(again["weights"], weights)
    other = staging.copy({"weights": torch.ones(5), "optimizer": moments, "clock": 8})
    assert other["weights"].data_ptr() != host["weights"].data_ptr() and other["weights"].shape == (5,)

"""tests/pool.py: a pooled rank is a fresh rank to the task it runs (no result may depend on which test
ran before in the same process), and a failed or hung task costs its world, never the run."""

import gc
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from petra_ds.runtime.distributed import free_port
from petra_ds.tools import spawn

import pool
from harness import launch, run_rank

pytestmark = pytest.mark.skipif(not pool.enabled(), reason="PETRA_DS_TEST_POOL=0: every launch is fresh")


def _dirty(spec):
    """Leave behind what a task could: a process group, another default dtype, a seeded generator, an
    environment variable, grad mode off, a frozen heap (an example's ``run_main`` freezes it before exiting, except
    where a nanobind extension is loaded: frozen here whatever the stack)."""
    import petra_ds

    petra_ds.init_distributed(dist_backend="gloo")
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    os.environ["POOL_TEST_LEFTOVER"] = "1"
    torch.set_grad_enabled(False)
    gc.collect()
    gc.freeze()
    return os.getpid()


def _look(spec):
    """What a rank sees when its task starts, then one all-reduce in the world it starts."""
    import torch.distributed as dist

    import petra_ds

    seen = {"pid": os.getpid(), "initialized": dist.is_initialized(), "dtype": str(torch.get_default_dtype()),
            "seed": torch.initial_seed(), "leftover": os.environ.get("POOL_TEST_LEFTOVER"),
            "spec_env": os.environ.get("POOL_TEST_SPEC_ENV"), "grad": torch.is_grad_enabled(),
            "threads": torch.get_num_threads(), "cwd": os.getcwd(),
            "frozen": gc.get_freeze_count() > spec["interpreter_frozen"]}
    petra_ds.init_distributed(dist_backend="gloo")
    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)
    return {**seen, "sum": total.item(), "world": dist.get_world_size()}


def _look_then_train(spec):
    """The fresh reference of both tests below, in one launch of spawned processes that import everything
    themselves: what a rank sees when its first task starts (``_look``), then the training run ``spec["train"]``
    in a world of its own (on ``spec["train_port"]``; ``_look``'s world ended first)."""
    from petra_ds.runtime.shutdown import shutdown

    seen = _look(spec)
    shutdown()
    os.environ["MASTER_PORT"] = str(spec["train_port"])
    return {"look": seen, "train": run_rank(spec["train"])}


#: what a bare interpreter freezes on its own (Python 3.12: a few hundred objects; 3.11: none): a rank has a frozen
#: heap when it holds more, one that a task froze
INTERPRETER_FROZEN = int(subprocess.check_output([sys.executable, "-c", "import gc; print(gc.get_freeze_count())"]))
SPEC_ENV = {"env": {"POOL_TEST_SPEC_ENV": "set"}, "interpreter_frozen": INTERPRETER_FROZEN}
TRAINING = {"pipe": 2, "stages_per_rank": 2, "k": 2, "train_batches": 3, "dropout": 0.1}


@pytest.fixture(scope="module")
def fresh():
    """What spawned ranks saw and trained (``_look_then_train``), by rank."""
    return spawn.launch({**SPEC_ENV, "train": TRAINING, "train_port": free_port()}, 2, target=_look_then_train)


def _fail_on_rank_1(spec):
    import torch.distributed as dist

    import petra_ds

    petra_ds.init_distributed(dist_backend="gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return os.getpid()


def _hang_on_rank_1(spec):
    import torch.distributed as dist

    import petra_ds

    petra_ds.init_distributed(dist_backend="gloo")
    if dist.get_rank() == 1:
        time.sleep(600)
    return os.getpid()


def test_a_reused_rank_sees_what_a_fresh_one_sees(fresh):
    pool.restart(2)
    pids = launch({}, 2, target=_dirty)
    pooled = launch(SPEC_ENV, 2, target=_look)
    assert [r["pid"] for r in pooled] == pids, "the second task ran in the first one's processes"
    for got, want in zip(pooled, [r["look"] for r in fresh]):
        assert not got["initialized"] and got["leftover"] is None and got["spec_env"] == "set"
        assert got["seed"] != 1234, "the generator is seeded afresh, as in a fresh rank"
        assert {**got, "pid": None, "seed": None} == {**want, "pid": None, "seed": None}
    assert [r["sum"] for r in pooled] == [3.0, 3.0]


def test_a_failed_task_costs_its_world_and_the_next_launch_starts_a_new_one():
    before = [r["pid"] for r in launch(SPEC_ENV, 2, target=_look)]
    with pytest.raises(RuntimeError, match="rank 1 fails on purpose"):
        launch({}, 2, target=_fail_on_rank_1, grace=30)
    after = launch(SPEC_ENV, 2, target=_look)
    assert not {r["pid"] for r in after} & set(before)
    assert [r["sum"] for r in after] == [3.0, 3.0]


def test_a_hung_task_is_killed_at_its_deadline():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="still running after 3 s"):
        launch({}, 2, target=_hang_on_rank_1, timeout=3)
    assert time.monotonic() - start < 30
    assert [r["sum"] for r in launch(SPEC_ENV, 2, target=_look)] == [3.0, 3.0]


def test_training_in_a_reused_world_equals_training_in_fresh_processes(fresh):
    """The same run, bit for bit, after another run (float32, other dropout) in the same processes, as in spawned
    processes that imported everything themselves (the reference for every pooled and forked rank)."""
    launch({**TRAINING, "dtype": "float32", "dropout": 0.3, "env": {"POOL_TEST_SPEC_ENV": "other"}})
    pooled = launch(TRAINING)
    for got, want in zip(pooled, [r["train"] for r in fresh]):
        assert got["params"].keys() == want["params"].keys() and got["params"]
        for name in want["params"]:
            assert torch.equal(got["params"][name], want["params"][name]), name
        assert len(got["losses"]) == len(want["losses"])
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got["losses"], want["losses"]))
        for j, steps in want["grads"].items():
            for a, b in zip(got["grads"][j], steps):
                assert all(torch.equal(a[n], b[n]) for n in b)

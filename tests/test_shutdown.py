"""A finished run exits 0: ``petra_ds.runtime.shutdown.shutdown`` ends the process groups, and joins gloo's threads,
before the interpreter's teardown, where a group freed late aborted finished runs ("terminate called
without an active exception"). ``before_exit`` keeps the teardown after it short, and quiet."""

import itertools
import os
import subprocess
import sys

import pytest
import torch

from petra_ds.runtime.distributed import free_port
from harness import launch
from subprocess_env import ROOT, launcher_env
from test_run_checkpoints import build_engine


def train_then_shut_down(spec: dict) -> dict:
    """A 2-rank PETRA run of the quickstart's toy network (J = 8); gloo's threads with the engine alive,
    after it is gone, and after shutdown."""
    import petra_ds
    from petra_ds.runtime.shutdown import communication_threads, shutdown

    def train() -> list[str]:
        from petra_ds.tools.toy import toy_data

        petra_ds.init_distributed()
        engine = build_engine()
        data = itertools.cycle(toy_data(4, 4, seed=0, dtype=torch.float32))
        for _ in range(3):
            engine.train_batch(data)
        return communication_threads()

    with_engine = train()
    return {"with_engine": with_engine, "without_engine": communication_threads(), "after": (shutdown(),
            communication_threads())[1], "initialized": torch.distributed.is_initialized()}


def test_shutdown_joins_the_pipeline_groups_threads():
    """The engine's four pipeline groups outlive it (DeepSpeed keeps the last pipeline grid at module
    level) until ``shutdown``; after it at most one group's threads are left: the world group, which
    DeepSpeed's optimizer set-up keeps referenced from C++ (never destroyed, so never torn down late)."""
    for rank in launch({}, 2, target=train_then_shut_down, fresh=True):  # a world of its own
        assert len(rank["with_engine"]) >= 4 * 3, rank  # a TCP loop and two work loops per group
        assert rank["without_engine"] == rank["with_engine"], rank  # dropping the engine frees nothing
        assert len(rank["after"]) <= 3, rank
        assert not rank["initialized"]


def test_shutdown_without_a_process_group_does_nothing():
    from petra_ds.runtime.shutdown import shutdown

    assert not torch.distributed.is_initialized()
    shutdown()
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_the_smallest_example_exits_0_fifty_times_in_a_row():
    """Before the groups were ended in the program, 3 of 14 and 5 of 44 benchmark launches aborted after
    their work was done (exit 250 under the deepspeed launcher: SIGABRT)."""
    script = os.path.join(ROOT, "examples", "quickstart", "train.py")
    config = os.path.join(ROOT, "ds_configs", "quickstart.json")
    failures = []
    for attempt in range(50):
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2",
               "--master_port", str(free_port()), script,
               "--deepspeed_config", config, "--steps", "3"]
        proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            failures.append((attempt, proc.returncode, proc.stderr[-1500:]))
    assert not failures, failures


#: a process that ends as a finished example does (``before_exit``), with an extension module of nanobind's making
#: in sys.modules when told: a module built from a shared library whose functions are of nanobind's ``nb_func`` type
ENDING = """
import gc, sys, types
from petra_ds.runtime.shutdown import before_exit
if sys.argv[1] == "nanobind":
    fake = types.ModuleType("fake_nanobind_ext")
    fake.__file__ = "/site-packages/fake_nanobind_ext.so"
    fake.getenv = type("nb_func", (), {})()
    sys.modules[fake.__name__] = fake
before = gc.get_freeze_count()
before_exit()
print(gc.get_freeze_count() - before)
"""


def _python(script: str, argument: str) -> subprocess.CompletedProcess:
    """``script`` run by this interpreter in a process of its own, with ``argument``."""
    return subprocess.run([sys.executable, "-c", script, argument], cwd=ROOT, env=launcher_env(),
                          capture_output=True, text=True, timeout=120)


def _newly_frozen(loaded: str) -> int:
    out = _python(ENDING, loaded)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_before_exit_freezes_what_is_alive_unless_a_nanobind_extension_is_loaded():
    assert _newly_frozen("none") > 10_000  # torch's and DeepSpeed's objects, frozen for a short teardown
    assert _newly_frozen("nanobind") == 0


#: a process holding triton's bindings (DeepSpeed's engine imports triton) that ends frozen (``freeze``) or as
#: ``before_exit`` ends it; prints whether those bindings are nanobind's
TRITON_ENDING = """
import gc, sys
import triton._C.libtriton
from petra_ds.runtime.shutdown import before_exit, nanobind_loaded
print(nanobind_loaded(), flush=True)
if sys.argv[1] == "freeze":
    gc.collect()
    gc.freeze()
else:
    before_exit()
"""


def test_a_process_holding_triton_s_nanobind_bindings_ends_without_leak_reports():
    """triton from 3.9 (torch 2.15's) is built with nanobind, which lists at exit every object of its own the
    teardown left alive; a frozen heap is never freed, so a frozen process ended with ~30 lines of "nanobind:
    leaked ..." (the first run below shows they are real here). Elsewhere the test skips, saying why."""
    def end(how: str) -> subprocess.CompletedProcess:
        out = _python(TRITON_ENDING, how)
        if "ModuleNotFoundError: No module named 'triton'" in out.stderr:
            pytest.skip("needs triton (torch's CUDA builds install it)")
        assert out.returncode == 0, out.stderr[-2000:]
        return out

    frozen = end("freeze")
    if frozen.stdout.split()[-1] != "True":  # its last line (DeepSpeed may write to stdout first)
        pytest.skip("this triton's bindings are not nanobind's (triton before 3.9, torch before 2.15): nothing "
                    "lists leaks at exit")
    assert "nanobind: leaked" in frozen.stderr, frozen.stderr[-2000:]
    ended = end("before_exit")
    assert "nanobind" not in ended.stderr, ended.stderr[-2000:]

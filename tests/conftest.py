"""Test-session hygiene shared by every test module."""

import compileall
import gc
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    """Compile the project's sources to bytecode once, before the session's processes start: about a hundred of them
    import petra_ds (fresh ranks, launchers, the examples), and with ``PYTHONDONTWRITEBYTECODE`` set, as on the CI
    machines, each would compile it anew (1-2 s of CPU each). Python reads bytecode whatever that variable says;
    it only stops processes from writing it. Files already compiled are skipped."""
    for folder in ("petra_ds", "examples", "benchmarks", "tests"):
        compileall.compile_dir(os.path.join(ROOT, folder), quiet=2, workers=1)
    _share_the_cores()


def _share_the_cores():
    """Each xdist worker computes on its share of the cores, by the rule ranks sharing a machine follow
    (``petra_ds.runtime.distributed.share_cores``, the workers counted as its ranks). torch's default, one thread
    per core in every worker, oversubscribes them: two workers with 2 threads each on 2 cores ran the host-overhead
    counts 3.7x slower than with one thread each (53 s against 14 s). The processes the tests start already run
    one thread each (``subprocess_env``, ``petra_ds.tools.spawn``). Only in a worker: the session process imports
    no DeepSpeed."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from petra_ds.runtime.distributed import share_cores

        share_cores({**os.environ, "LOCAL_WORLD_SIZE": os.environ["PYTEST_XDIST_WORKER_COUNT"]})


def pytest_unconfigure(config):
    """This process (the session's, or an xdist worker) ends next: its teardown need not walk everything the tests
    created. A worker, whose tests imported DeepSpeed, ends as an example does
    (``petra_ds.runtime.shutdown.before_exit``, which freezes nothing where a nanobind extension is loaded); the
    session process has no DeepSpeed, and no extension of nanobind's, and freezes what it holds."""
    if "deepspeed" in sys.modules:
        from petra_ds.runtime.shutdown import before_exit

        before_exit()
    else:
        gc.collect()
        gc.freeze()


@pytest.fixture(autouse=True)
def _default_dtype():
    """Oracles switch the default dtype to float64; no test sees another test's choice."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture(scope="session", autouse=True)
def _rank_pool():
    """The pooled rank processes (tests/pool.py) stop with the session."""
    import pool

    yield
    pool.shutdown()


@pytest.fixture(scope="module")
def world_of_one():
    """torch.distributed with this process as its only rank; the environment and the process group are
    put back afterwards so that the tests which launch processes see what they saw before (an inherited
    MASTER_PORT would point them at this process's store)."""
    import petra_ds
    from deepspeed import comm as ds_comm

    saved = dict(os.environ)
    started = not ds_comm.is_initialized()
    if started:
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(var, None)
        petra_ds.init_distributed(dist_backend="gloo")
    yield
    if started:
        ds_comm.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def deepspeed_warnings():
    """The warnings logged through DeepSpeed's logger (which petra_ds's notices use) during the test, as text."""
    import logging

    from deepspeed.utils import logger

    messages: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Kept(logging.WARNING)
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)

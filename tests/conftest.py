"""Test-session hygiene shared by every test module."""

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _default_dtype():
    """Oracles switch the default dtype to float64; no test sees another test's choice."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


SHM_DIR, SHM_PREFIX = "/dev/shm", "deepspeed_allreduce_buffer"


def _shm_buffers() -> set[str]:
    if not os.path.isdir(SHM_DIR):
        return set()
    return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}


@pytest.fixture(autouse=True)
def _deepspeed_shm_buffers():
    """DeepSpeed's CPU communication op maps a shared-memory buffer (~66 MB) per process and launch and
    never unlinks it: the slow tests alone launch enough processes to fill a 24 GiB machine's memory.
    Remove what this test's processes left behind (they have exited; this process still maps its own)."""
    before = _shm_buffers()
    yield
    left = _shm_buffers() - before
    if not left:
        return
    with open("/proc/self/maps") as f:
        mapped = f.read()
    for name in left:
        if name not in mapped:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


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

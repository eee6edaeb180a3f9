"""petra_ds.tools.spawn's clean-up of DeepSpeed's shared-memory buffers: a buffer goes once its launch has
ended, never while the launch runs, even before any process maps it (its peers wait for it to appear)."""

import mmap
import os
import socket

import pytest

from petra_ds.tools.spawn import SHM_DIR, SHM_PREFIX, buffer_port, deepspeed_shm_buffers, remove_deepspeed_shm_buffers

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason=f"no {SHM_DIR} on this machine")


def _buffer(port: int, rank: int) -> str:
    name = f"{SHM_PREFIX}_{os.getuid()}_127.0.0.1_{port}_{rank}"
    with open(os.path.join(SHM_DIR, name), "wb") as f:
        f.write(b"\0" * 4096)
    return name


def test_the_port_is_read_from_the_name():
    assert buffer_port(f"{SHM_PREFIX}_0_127.0.0.1_29500_1") == 29500
    assert buffer_port(f"{SHM_PREFIX}_0__1") is None


def test_only_the_buffers_of_an_ended_launch_go():
    running, ended = socket.socket(), socket.socket()
    running.bind(("127.0.0.1", 0))
    running.listen()  # a launch's store: the launch runs
    ended.bind(("127.0.0.1", 0))
    ended_port = ended.getsockname()[1]
    ended.close()  # a launch whose store has closed
    before = deepspeed_shm_buffers()
    starting = _buffer(running.getsockname()[1], 0)  # written, not mapped yet
    done, held = _buffer(ended_port, 0), _buffer(ended_port, 1)
    try:
        with open(os.path.join(SHM_DIR, held), "r+b") as f, mmap.mmap(f.fileno(), 4096):
            remove_deepspeed_shm_buffers(before)
            left = deepspeed_shm_buffers()
        assert starting in left  # its launch still runs: its peers may be waiting for it
        assert held in left  # a live process maps it
        assert done not in left  # ended and unmapped
    finally:
        running.close()
        for name in (starting, done, held):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))

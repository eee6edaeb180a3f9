"""The run's processes and their groups: start torch.distributed (one plain process included), the
timeouts of the pipeline's groups, torchrun's restarts, who speaks for the run."""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Iterator

import deepspeed
import deepspeed.ops
import torch
from deepspeed.constants import default_pg_timeout
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.utils import logger


def is_rank0() -> bool:
    """Whether this process speaks for the run: global rank 0, or the only process before
    torch.distributed starts (never ``LOCAL_RANK``, which is 0 once per node)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


#: where the kernel takes the local ports of outgoing connections when the system does not say
EPHEMERAL_PORTS = (32768, 60999)
#: the lowest port :func:`free_port` returns
LOWEST_FREE_PORT = 10000


def ephemeral_ports() -> tuple[int, int]:
    """The range of local ports the kernel gives outgoing connections (Linux's ``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(part) for part in f.read().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_PORTS


def free_port() -> int:
    """A TCP port for a rendezvous store that no socket on any of this machine's addresses holds now, chosen below
    the ephemeral range. torch's store listens on every address: a port free on the loopback alone can be held on
    the network interface's address (NCCL's bootstrap listens there: EADDRINUSE on an H200), and a port of the
    ephemeral range can become the local port of any new outgoing connection between this choice and the store's
    bind (a gloo or store connection of another run: 1 of 50 launches beside the test suite)."""
    low = ephemeral_ports()[0]
    if low - LOWEST_FREE_PORT >= 1000:
        # a generator of its own, seeded by the system: processes that seeded Python's alike must not pick alike
        for port in random.Random().sample(range(LOWEST_FREE_PORT, low), 64):
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ensure_single_process_env() -> None:
    """Let a plain ``python script.py`` (one process hosting every stage) start torch.distributed."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


#: the timeout given to :func:`init_distributed`, for the pipeline's process groups
_group_timeout: timedelta | None = None


#: DeepSpeed's CPU shared-memory all-reduce op (``deepspeed.ops.op_builder.cpu.comm.ShareMemCommBuilder``)
SHM_COMM_OP = "deepspeed_shm_comm"


def shm_comm_build_note() -> str | None:
    """What to tell the user before ``deepspeed.init_distributed`` JIT-compiles DeepSpeed's CPU communication
    op (``deepspeed_shm_comm``: the first init on a CPU machine builds it, 1-2 minutes without output, and
    needs a C++ compiler, or every launch fails with "Error building extension 'deepspeed_shm_comm'"); None
    when nothing will be built: a GPU, oneCCL, DeepSpeed already initialized, the op shipped prebuilt or
    already in torch's extension directory."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    accelerator = get_accelerator()
    if (deepspeed.comm.is_initialized() or accelerator.device_name() != "cpu"
            or accelerator.communication_backend_name() == "ccl"):
        return None
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    if builder is None or installed_ops.get(builder.NAME, False) or not builder.is_compatible():
        return None
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:  # torch.utils.cpp_extension's layout: <build root>/py311_cu130/<name>/<name>.so
        if torch.version.hip:
            build = "rocm" + torch.version.hip
        elif torch.version.cuda:
            build = "cu" + torch.version.cuda
        else:
            build = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{build.replace('.', '')}")
    if os.path.exists(os.path.join(root, builder.NAME, builder.NAME + ".so")):
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return ("DeepSpeed's CPU communication op needs a C++ compiler and none was found: install g++ "
                "(apt-get install g++), or the start fails with \"Error building extension 'deepspeed_shm_comm'\"")
    return "building DeepSpeed's CPU communication op (needs g++, about a minute the first time)"


@contextmanager
def _shm_comm_op_off() -> Iterator[None]:
    """DeepSpeed sets up its CPU shared-memory op in ``init_distributed`` only when
    ``deepspeed.ops.__compatible_ops__`` marks it compatible; mark it not for the duration of the call."""
    compatible = deepspeed.ops.__compatible_ops__
    before = compatible.get(SHM_COMM_OP, False)
    compatible[SHM_COMM_OP] = False
    try:
        yield
    finally:
        compatible[SHM_COMM_OP] = before


def init_distributed(dist_backend: str | None = None, timeout: timedelta | None = None, *,
                     cpu_comm_op: bool = False, **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` that also works in a plain ``python`` process (one rank).

    ``timeout`` (default: DeepSpeed's, ``$DEEPSPEED_TIMEOUT`` minutes) bounds how long a rank waits on
    a peer that stopped answering without dying (a dead process is noticed within seconds);
    :func:`initialize` gives the pipeline's own process groups the same bound.

    On a CPU machine DeepSpeed's own init sets up its shared-memory all-reduce op (``deepspeed_shm_comm``),
    used only by ``deepspeed.comm.inference_all_reduce``, which PETRA never calls: a C++ build of 1-2 minutes
    the first time (none without g++), and a 66 MB ``/dev/shm`` buffer per process that DeepSpeed never
    removes. This init leaves it off; ``cpu_comm_op=True`` keeps DeepSpeed's default (rank 0 then says
    first when the op is about to be compiled)."""
    global _group_timeout
    ensure_single_process_env()
    check_elastic_store(os.environ)
    share_cores(os.environ)
    timeout = timeout or default_pg_timeout
    note = shm_comm_build_note() if cpu_comm_op and os.environ.get("RANK", "0") == "0" else None
    if note:
        print(note, flush=True)
    with nullcontext() if cpu_comm_op else _shm_comm_op_off():
        deepspeed.init_distributed(dist_backend=dist_backend, timeout=timeout, **kwargs)
    _group_timeout = timeout


def share_cores(env: Any) -> int | None:
    """On a CPU machine each of the ranks a launcher started here computes on its share of the cores, unless
    ``OMP_NUM_THREADS`` says otherwise: torch's default, a thread per core in every rank, oversubscribes them, and
    DeepSpeed's launcher sets ``OMP_NUM_THREADS`` only with ``--bind_cores_to_rank`` (torchrun sets 1). Returns
    the threads set (None: left alone)."""
    from deepspeed.accelerator import get_accelerator

    local = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 1)
    if local <= 1 or "OMP_NUM_THREADS" in env or get_accelerator().device_name() != "cpu":
        return None
    threads = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)
    return threads


#: what makes torchrun's restarted workers safe: a fresh store per attempt (pytorch/pytorch#135712)
SEPARATE_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def check_elastic_store(env: Any) -> None:
    """torchrun (c10d rendezvous) lends its workers its own store, the same one for every restart: a
    restarted worker then reads the addresses the previous attempt's workers published and its process
    groups fail to connect or wait forever (pytorch/pytorch#135712). Warn when restarts are allowed on
    that store; stop a restarted worker on it with the fix instead of letting it hang."""
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not shared or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return
    fix = (f"launch torchrun with {SEPARATE_STORE} in its environment (each attempt then gets a store of its "
           "own)")
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        raise RuntimeError(f"this worker was restarted by torchrun on the store of its first attempt, where its "
                           f"process groups would meet the previous workers' addresses and hang: {fix}")
    if env.get("RANK", "0") == "0":
        logger.warning(f"torchrun may restart these workers (--max-restarts), but they share its rendezvous store; "
                       f"a restarted worker could not connect: {fix}")


def apply_group_timeout_to(model: Any) -> None:
    """Give a ``PipelineModule``'s groups the timeout :func:`init_distributed` was given (nothing else when
    it was not called)."""
    if _group_timeout is not None and isinstance(model, PipelineModule):
        apply_group_timeout(model.mpu(), _group_timeout)


def apply_group_timeout(grid: Any, timeout: timedelta) -> None:
    """Give a pipeline grid's pipe, data- and model-parallel groups ``timeout``: torch creates them
    with its own default (30 minutes for gloo) whatever the world group was given."""
    set_timeout = getattr(torch.distributed, "set_timeout", None) or getattr(
        torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    getters = ("get_pipe_parallel_group", "get_data_parallel_group", "get_model_parallel_group",
               "get_slice_parallel_group")
    groups = {id(g): g for g in (getattr(grid, name)() for name in getters) if g is not None}
    for group in groups.values():
        if torch.distributed.get_rank(group) >= 0:  # -1: this rank is not in the group
            set_timeout(timeout, group)

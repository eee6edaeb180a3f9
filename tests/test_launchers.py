"""The quickstart example under DeepSpeed's launcher (4 CPU processes, gloo) and as plain python, each with
the layout fitted to its processes."""

import json
import os
import subprocess
import sys

import pytest
import torch

from petra_ds.runtime.distributed import free_port
from subprocess_env import ROOT, launcher_env

SCRIPT = os.path.join(ROOT, "examples", "quickstart", "train.py")
CONFIG = os.path.join(ROOT, "ds_configs", "quickstart.json")


def run(cmd, tmp_path, printed=()):
    out = tmp_path / "summary.json"
    proc = subprocess.run(cmd + ["--output", str(out)], cwd=ROOT, env=launcher_env(), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in printed:
        assert line in proc.stdout
    return json.loads(out.read_text())


def test_deepspeed_launcher_runs_two_pipeline_ranks(tmp_path):
    """9 toy layers on 2 processes: the layout fitted to them is 2 ranks x 4 stages (J = 8)."""
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    summary = run([deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), SCRIPT, "--deepspeed_config", CONFIG, "--steps", "10"], tmp_path)
    assert summary["world_size"] == 2 and summary["num_stages"] == 8 and summary["stages_per_rank"] == 4
    assert summary["clock"] == 10 * 2 + 2 * (8 - 1)  # k clocks per train_batch, then the drain
    losses = summary["losses"]
    # micro-batch 0 reaches the loss at clock J - 1 = 7, in the 4th call (k = 2): the first three are NaN
    assert all(l != l for l in losses[:3]), losses
    assert all(0 < l < 5 for l in losses[3:])
    assert 0 < summary["eval_loss"] < 5


def test_plain_python_hosts_every_stage_in_one_process(tmp_path):
    """The paper's single-device setting: all 9 stages, one per layer, in one process."""
    summary = run([sys.executable, SCRIPT, "--deepspeed_config", CONFIG, "--steps", "12"], tmp_path,
                  printed=["the loss is nan until the pipeline has filled: the first micro-batch reaches the last of "
                           "the 9 stages at clock 8"])
    assert summary["world_size"] == 1 and summary["num_stages"] == 9 and summary["stages_per_rank"] == 9
    losses = summary["losses"]
    assert all(l != l for l in losses[:4]) and all(0 < l < 5 for l in losses[4:]), losses  # loss at clock 8
    assert losses[-1] < losses[4]


def _reduce_both_ways(spec):
    """DeepSpeed's all-reduce and its inference all-reduce (the one user of its CPU op) in a world that
    petra_ds.init_distributed started; whether the op's kernel is registered with torch."""
    from deepspeed import comm as ds_comm

    import petra_ds

    petra_ds.init_distributed(dist_backend="gloo")
    plain, inference = torch.full((3,), ds_comm.get_rank() + 1.0), torch.full((3,), ds_comm.get_rank() + 1.0)
    ds_comm.all_reduce(plain)
    ds_comm.inference_all_reduce(inference)
    return {"plain": plain.tolist(), "inference": inference.tolist(),
            "op_loaded": hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")}


def test_init_distributed_neither_builds_nor_maps_deepspeeds_cpu_communication_op(tmp_path):
    """DeepSpeed's own init would JIT-compile deepspeed_shm_comm into an empty extension directory (a
    minute, needs g++) and leave a 66 MB /dev/shm buffer per process; PETRA never calls the inference
    all-reduce it serves. Two ranks: no build, no buffer, both all-reduces still sum."""
    import glob

    from harness import launch

    def buffers():  # DeepSpeed's name for them: deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
        return set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))

    extensions = tmp_path / "torch_extensions"
    before = buffers()
    results = launch({"env": {"TORCH_EXTENSIONS_DIR": str(extensions)}}, 2, target=_reduce_both_ways)
    assert results == [{"plain": [3.0] * 3, "inference": [3.0] * 3, "op_loaded": False}] * 2
    assert not list(extensions.rglob("*.so")) and not list(extensions.rglob("build.ninja"))
    assert buffers() - before == set()


def test_cpu_comm_op_true_keeps_deepspeeds_default_and_says_first_when_it_compiles(tmp_path, monkeypatch, capsys):
    """``cpu_comm_op=True`` hands DeepSpeed its own op table unchanged (init then builds and maps the op), and
    rank 0 is told before a build starts, unless torch's extension directory holds the build."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import petra_ds
    from petra_ds.runtime.distributed import SHM_COMM_OP, shm_comm_build_note

    if get_accelerator().device_name() != "cpu":
        pytest.skip("the op is built on CPU machines only")
    seen = []
    monkeypatch.setattr(deepspeed, "init_distributed",
                        lambda **kwargs: seen.append(deepspeed.ops.__compatible_ops__[SHM_COMM_OP]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", sys.executable)  # an executable that exists: the build would start
    compatible = deepspeed.ops.__compatible_ops__[SHM_COMM_OP]
    petra_ds.init_distributed(dist_backend="gloo")
    petra_ds.init_distributed(dist_backend="gloo", cpu_comm_op=True)
    assert seen == [False, compatible] and deepspeed.ops.__compatible_ops__[SHM_COMM_OP] == compatible
    assert capsys.readouterr().out.splitlines() == [
        "building DeepSpeed's CPU communication op (needs g++, about a minute the first time)"]
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    assert "needs a C++ compiler and none was found: install g++" in shm_comm_build_note()
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert shm_comm_build_note() is None  # built before: loading it takes a second


def test_torchruns_shared_store_is_refused_to_a_restarted_worker_and_named_before():
    """pytorch/pytorch#135712: on the agent's store a restarted worker's groups meet the previous
    attempt's addresses and hang; the first attempt is warned, a restarted one stopped, both with the fix."""
    import logging

    import pytest
    from deepspeed.utils import logger

    from petra_ds.runtime.distributed import SEPARATE_STORE, check_elastic_store

    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0"}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        check_elastic_store({**env, "TORCHELASTIC_RESTART_COUNT": "0"})
        check_elastic_store({**env, "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "1"})
        check_elastic_store({**env, "TORCHELASTIC_MAX_RESTARTS": "0"})
    finally:
        logger.removeHandler(handler)
    assert len(records) == 1 and SEPARATE_STORE in records[0].getMessage()
    with pytest.raises(RuntimeError, match=SEPARATE_STORE):
        check_elastic_store({**env, "TORCHELASTIC_RESTART_COUNT": "1"})


@pytest.mark.parametrize("env,threads", [
    ({"LOCAL_SIZE": "2"}, max(1, os.cpu_count() // 2)),  # DeepSpeed's launcher, 2 ranks here
    ({"LOCAL_WORLD_SIZE": "4"}, max(1, os.cpu_count() // 4)),  # torchrun's name for it
    ({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}, None),  # the user's choice stands
    ({"LOCAL_SIZE": "1"}, None), ({}, None)])
def test_ranks_on_a_cpu_machine_share_its_cores(env, threads):
    """Ranks sharing a CPU machine compute on a share of its cores each, not on all of them each (two processes
    with a thread per core each on this 2-core machine ran 3.7x slower than with a thread each)."""
    from petra_ds.runtime.distributed import share_cores

    before = torch.get_num_threads()
    torch.set_num_threads(7)
    try:
        assert share_cores(env) == threads
        assert torch.get_num_threads() == (7 if threads is None else threads)
    finally:
        torch.set_num_threads(before)


def test_a_free_port_is_free_on_every_address_the_rendezvous_store_listens_on(monkeypatch):
    """A port held on another local address (NCCL's bootstrap holds ports on a GPU machine's network address) is
    free on the loopback yet refused to torch's store, which listens on every address (EADDRINUSE on an H200):
    free_port asks the system for a port free on the wildcard address."""
    import socket

    from petra_ds.runtime import distributed

    with socket.socket() as held:
        held.bind(("127.0.0.2", 0))
        held.listen()
        port = held.getsockname()[1]
        with socket.socket() as loopback:
            loopback.bind(("127.0.0.1", port))  # what the loopback-only check saw: free
        with socket.socket() as wildcard, pytest.raises(OSError):
            wildcard.bind(("", port))  # what the store then met
    asked = []

    class Recording(socket.socket):
        def bind(self, address):
            asked.append(address)
            return super().bind(address)

    monkeypatch.setattr(distributed.socket, "socket", Recording)
    port = distributed.free_port()
    assert asked and all(host == "" for host, _ in asked) and asked[-1][1] == port


def test_a_free_port_is_outside_the_range_outgoing_connections_take_their_ports_from():
    """A port of the ephemeral range, free when chosen, can become the local port of a new outgoing connection
    before the store binds it (EADDRINUSE at the 37th of fifty launches beside the test suite): the ports chosen
    are below that range, and free on every address."""
    import socket

    from petra_ds.runtime.distributed import LOWEST_FREE_PORT, ephemeral_ports, free_port

    low, high = ephemeral_ports()
    assert low <= high
    for _ in range(20):
        port = free_port()
        assert LOWEST_FREE_PORT <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("", port))

"""Several machines: two torchrun agents on this machine act as two nodes of 2 processes each (one
rendezvous endpoint, --node-rank 0 and 1). The run uses global ranks for its layout and every rank-0
decision (LOCAL_RANK only picks the device), so it equals the same 4 processes on one node."""

import json
import os
import subprocess
import sys

import pytest

from petra_ds.runtime.distributed import free_port
from subprocess_env import ROOT, launcher_env

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
SCRIPT = [os.path.join(ROOT, "examples", "quickstart", "train.py"), "--deepspeed_config",
          os.path.join(ROOT, "ds_configs", "quickstart.json"), "--steps", "8"]


def node(nnodes: int, node_rank: int, per_node: int, port: int, out) -> subprocess.Popen:
    cmd = [TORCHRUN, "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc_per_node", str(per_node),
           "--master_addr", "127.0.0.1", "--master_port", str(port), *SCRIPT, "--output", str(out)]
    return subprocess.Popen(cmd, cwd=ROOT, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.slow
def test_two_nodes_of_two_processes_equal_one_node_of_four(tmp_path):
    one = node(1, 0, 4, free_port(), tmp_path / "one.json")
    log = one.communicate(timeout=600)[0]
    assert one.returncode == 0, log[-3000:]
    port = free_port()
    nodes = [node(2, r, 2, port, tmp_path / f"two-{r}.json") for r in (0, 1)]
    logs = [n.communicate(timeout=600)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [log[-3000:] for log in logs]
    assert not (tmp_path / "two-1.json").exists()  # global rank 0 (on node 0) alone writes the summary
    single, multi = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two-0.json"))
    assert multi["world_size"] == 4 and multi["num_stages"] == 8 and multi["stages_per_rank"] == 2
    assert multi["losses"][3:] == single["losses"][3:] and multi["eval_loss"] == single["eval_loss"]
    assert multi["settings"] == single["settings"]

"""Environment for tests that start a launcher in a subprocess."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launcher_env() -> dict:
    """This environment without a torch.distributed rendezvous, one thread per process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env

"""Where the repository is, the environment for tests that start a launcher in a subprocess, and the
example and benchmark scripts loaded as modules."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launcher_env() -> dict:
    """This environment without a torch.distributed rendezvous, one thread per process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def load_example(name: str):
    """examples/<name>/train.py as a module named ``<name>_example`` (examples are scripts, not a package)."""
    path = os.path.join(ROOT, "examples", name, "train.py")
    spec = importlib.util.spec_from_file_location(f"{name}_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module named ``<name>_benchmark`` (benchmarks/ is a folder of scripts)."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench

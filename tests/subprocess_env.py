"""Where the repository is, the environment for tests that start a launcher in a subprocess, the example
scripts loaded as modules, and the benchmarks' modules by name."""

import importlib
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


#: the modules of benchmarks.lib whose name is not the benchmark's
BENCHMARK_MODULES = {"accuracy": "vision_accuracy", "memory": "memory_held", "gpu": "single_gpu"}


def load_benchmark(name: str):
    """The module of ``benchmarks.lib`` that holds the benchmark ``name`` ("throughput", "accuracy", ...), imported
    (the repository root is on the tests' path: pyproject's ``pythonpath``)."""
    return importlib.import_module(f"benchmarks.lib.{BENCHMARK_MODULES.get(name, name)}")

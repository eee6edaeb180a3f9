"""Shared by the benchmarks: where the repository is, running one example training under the deepspeed launcher
and reading back what it wrote, saving a report. One place, so every benchmark launches and writes alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from petra_ds.util.files import write_text_atomic

#: the repository root: examples, configs and reports are named relative to it
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


#: what the accuracy benchmarks compare: backprop, the paper's PETRA and PETRA with each delay compensation
METHODS = ("backprop", "petra", "weight_prediction", "lr_rescale")


def launcher(procs: int) -> list[str]:
    """This Python for one process (PETRA's stages all in it), the deepspeed launcher for more."""
    return [sys.executable] if procs == 1 else [DEEPSPEED, "--num_gpus", str(procs)]


def method_arguments(method: str) -> list[str]:
    """The example's flags for a benchmark method: "petra" is the paper's (an LM config may ship a
    compensation, so it is turned off by name), the others name their compensation."""
    if method == "backprop":
        return []
    return ["--delay-compensation", "none" if method == "petra" else method]


def read_run(output_dir: str) -> tuple[dict, list[dict]]:
    """(summary.json, metrics.jsonl rows) an example wrote to ``output_dir``."""
    with open(os.path.join(ROOT, output_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(ROOT, output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return summary, rows


def run_example(cmd: list[str], output_dir: str, env: dict | None = None) -> tuple[dict, list[dict], float]:
    """(summary.json, metrics.jsonl rows, wall seconds) of ``cmd`` run from the repository root with
    one thread per process (and ``env`` added to the environment)."""
    start = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    wall = time.time() - start
    return (*read_run(output_dir), wall)


def module_env(env: dict) -> dict:
    """``env`` with the repository root first on PYTHONPATH, so that a process started as
    ``python -m benchmarks.lib.<module>`` imports ``benchmarks`` wherever it starts."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": ROOT if not path else ROOT + os.pathsep + path}


def save_report(output: str, report: dict) -> str:
    """Write ``report`` as JSON to ``output`` (relative to the repository root) through a temporary file
    and a rename, so a stopped benchmark never leaves half a report; returns the path."""
    path = os.path.join(ROOT, output)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text_atomic(path, json.dumps(report, indent=1))
    return path


def one_cpu_process() -> None:
    """This process as a one-rank CPU world with one thread (what a host-cost measurement runs in), with no GPU
    visible: a CUDA build of torch, where CUDA never starts, asks NVML for the device count at every torch
    optimizer step (its capture check, through ``torch.accelerator``), a library load each time that a GPU process
    makes once and caches; PETRA's J optimizers in one process would pay it J times per call, plain backprop's
    once, a cost no GPU run has."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    from deepspeed import comm

    import petra_ds

    torch.set_num_threads(1)
    if not comm.is_initialized():
        petra_ds.init_distributed(dist_backend="gloo")

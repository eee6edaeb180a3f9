"""Run a function in N fresh CPU processes (gloo) and collect what each returned, or how it ended.

``launch(spec, world_size, target=f)`` starts ``world_size`` processes, each set up as one rank of a
torch.distributed world on the loopback (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, one
thread), calls ``f(spec)`` in each and returns the results by rank, or raises with every failed rank's
traceback. ``f`` must be a module-level function: the processes are started with the ``spawn`` method,
which sends it by reference (module and name) and gives the processes this process's ``sys.path``, so
any function this process can import qualifies. ``f`` starts torch.distributed itself (e.g. with
:func:`petra_ds.init_distributed`, which reads those variables). ``start_method="forkserver"`` forks each
process from multiprocessing's fork server instead: still a new process that ran nothing before, but it
starts with whatever ``multiprocessing.set_forkserver_preload`` had the server import (torch and DeepSpeed
take seconds per process to import).

``run_processes`` does the same and reports each rank's end, failed, killed or hung, for runs where a
rank may die.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

from ..runtime.distributed import free_port
from ..runtime.shutdown import before_exit, shutdown
from ..util.files import replace_atomically

def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables that make a process rank ``rank`` of a ``world``-process world on the loopback."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _write_result(value: Any, path: str) -> None:
    """A rank's result for the launching process, pickled as multiprocessing pickles what its processes send
    each other (results hold any Python object; they never leave the launch's private directory)."""
    replace_atomically(path, lambda f: pickle.dump(value, f), binary=True)


def _read_result(path: str) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def _entry(rank: int, world: int, port: int, spec: dict, out_dir: str, target: Callable[[dict], Any]) -> None:
    os.environ.update(spec.get("env", {}))
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        result = target(spec)
    except BaseException:
        _write_result({"error": traceback.format_exc()}, path)
        raise
    _write_result(result, path)
    shutdown()  # end the groups now, not in the interpreter's teardown
    before_exit()


def run_processes(spec: dict[str, Any], world_size: int, timeout: float = 300, grace: float | None = None, *,
                  target: Callable[[dict], Any], start_method: str = "spawn") -> list[dict]:
    """Run ``target(spec)`` (a module-level function) in ``world_size`` fresh processes and report on each,
    failed or not: ``exitcode`` (negative: killed by that signal; None: still running at the deadline,
    then killed), ``ended`` (wall-clock time its exit was seen) and ``result`` or ``error`` (its
    traceback). The deadline is ``timeout``, or ``grace`` seconds after the first process that fails, if
    sooner. ``spec["env"]`` (a dict) is set in every process."""
    ctx = mp.get_context(start_method)
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, spec, out_dir, target))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        ended: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while len(ended) < world_size and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and not p.is_alive():
                    ended[r] = time.time()
                    if p.exitcode and grace is not None:
                        deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.05)
        exitcodes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            saved = _read_result(path) if os.path.exists(path) else {"error": "no result"}
            outcome = {"rank": r, "exitcode": exitcodes[r], "ended": ended.get(r)}
            outcome.update({"error": saved["error"]} if isinstance(saved, dict) and "error" in saved
                           else {"result": saved})
            outcomes.append(outcome)
    return outcomes


def raise_failures(outcomes: list[dict]) -> list[Any]:
    """The results by rank, or a RuntimeError with every failed rank's traceback (the first one to fail
    is not always rank 0)."""
    failed = [f"rank {o['rank']} failed:\n{o['error']}" for o in outcomes if "error" in o]
    if failed:
        raise RuntimeError("\n".join(failed))
    return [o["result"] for o in outcomes]


def launch(spec: dict[str, Any], world_size: int, timeout: float = 300, grace: float | None = None, *,
           target: Callable[[dict], Any], start_method: str = "spawn") -> list[Any]:
    """Run ``target(spec)`` in ``world_size`` fresh processes; return their results by rank, or raise
    with every failed rank's traceback."""
    return raise_failures(run_processes(spec, world_size, timeout, grace, target=target, start_method=start_method))

"""A session-wide pool of rank processes, reused by the tests that run a function on every rank of a
CPU (gloo) world.

A fresh rank costs seconds before it does anything (importing torch and DeepSpeed), and a test launches
up to four of them on a two-core machine; the pool pays that once per session: its ranks are forked from a
server that imported ``petra_ds`` (:func:`context`). A *world* is N such worker processes that hold no
process group. Each task, ``target(spec)`` on every rank, runs in a worker put back to what a fresh rank
would see:

- ``os.environ`` is the test process's environment at launch time, then ``spec["env"]``, then the rank's
  variables with a new ``MASTER_PORT`` (so nothing one test set leaks into the next); the working
  directory is the test process's;
- torch's default dtype is float32, grad mode is on, one thread; torch's, Python's and NumPy's generators
  are seeded from the OS, as they are in a fresh process (nothing may depend on their state);
- ``target`` starts torch.distributed itself, as in a fresh rank (a new world group, its own timeout);
- afterwards every rank meets at a barrier, then every process group is destroyed
  (``deepspeed.comm.destroy_process_group`` also drops DeepSpeed's cached groups and ``mpu``) and the
  engine is garbage collected. No message or group of one task can reach the next one. (The module
  state that remains is set again by the next run: ``petra_ds.init_distributed`` sets its group
  timeout, every PipelineEngine the pipeline p2p module's grid.)

A world in which a rank failed, died or did not answer by the deadline (``timeout``, or ``grace`` after
the first failure) is killed, all of it, and the next launch of that size starts a new one; so a test
that expects an error costs what it cost with fresh processes. A world is also replaced after
``MAX_TASKS`` tasks, and the least recently used worlds stop when more than ``MAX_PROCESSES`` processes
would run. ``PETRA_DS_TEST_POOL=0`` turns the pool off (every launch gets fresh processes);
``PETRA_DS_TEST_POOL_LOG=<file>`` appends a line per task (world size, new or reused, seconds, test).

Runs that kill a rank, or that must start from fresh processes (resuming from a checkpoint "in fresh
processes"), use :func:`petra_ds.tools.spawn.launch` instead (``harness.launch(..., fresh=True)``): new
processes forked from the same server, which ran nothing before; ``fresh="spawn"`` spawns them, the reference
the pool's own tests compare against.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

import numpy
import torch

from petra_ds.tools import spawn
from petra_ds.runtime.distributed import free_port

#: a world is replaced after this many tasks (bounds whatever a task leaves behind in a worker)
MAX_TASKS = 40
#: at most this many pooled processes (~0.5 GB each): the least recently used worlds make room. 10 keeps
#: the worlds of 1, 2, 3 and 4 ranks the suite uses all alive
MAX_PROCESSES = 10


def enabled() -> bool:
    return os.environ.get("PETRA_DS_TEST_POOL", "1") != "0"


# --- the worker (one rank) ---

def _watch_parent(parent: int) -> None:
    """Exit when the test process is gone (a hung task would otherwise keep this rank alive). The test process
    is not this rank's parent (the fork server is): ask whether it still exists."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGKILL)


def _reset(rank: int, world: int, port: int, env: dict, cwd: str, spec: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(spec.get("env", {}))
    os.environ.update(spawn.rank_env(rank, world, port))
    os.chdir(cwd)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.seed()  # from the OS, as torch seeds a fresh process; so do Python and NumPy
    random.seed()
    numpy.random.seed()
    torch.set_grad_enabled(True)


def _teardown() -> None:
    """Leave no process group and no engine behind (``petra_ds.runtime.shutdown``), and no frozen heap: a task that
    ran an example's ``run_main`` ended as a finished process does, freezing what it held
    (``petra_ds.runtime.shutdown.before_exit``). (What DeepSpeed and petra_ds keep at module level besides is set
    again by the next run: ``petra_ds.init_distributed`` its group timeout.)"""
    from petra_ds.runtime.shutdown import shutdown

    shutdown()
    gc.unfreeze()


def _serve(rank: int, world: int, conn: Any, parent: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(1)
    importlib.import_module("petra_ds")  # torch, DeepSpeed and the engine (already there, from the fork server)

    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        except BaseException:  # the target could not be unpickled (imported)
            conn.send(("error", traceback.format_exc()))
            return
        target, spec, port, env, cwd = task
        try:
            _reset(rank, world, port, env, cwd, spec)
            buffer = io.BytesIO()
            torch.save(target(spec), buffer)
            reply = ("ok", buffer.getvalue())
            del buffer
            _teardown()
        except BaseException:
            reply = ("error", traceback.format_exc())
        conn.send(reply)
        if reply[0] != "ok":
            return


# --- the test process's side ---

#: what the fork server imports once, beside ``petra_ds``: the examples' heavy imports (scikit-learn's digits,
#: torchvision, matplotlib's pyplot, the Hugging Face decoders and Reformer, DeepSpeed's Muon, which imports
#: torch's inductor), about 13 s per rank of every example launch
EXAMPLE_IMPORTS = ("sklearn.datasets", "torchvision", "matplotlib.pyplot", "petra_ds.models.decoder",
                   "petra_ds.models.reformer", "deepspeed.runtime.zero.muon.muon_optimizer", "datasets")


def context() -> Any:
    """Ranks forked from a server that imported ``petra_ds`` (torch and DeepSpeed) and the examples' heavy imports
    once: a world starts in milliseconds, not the seconds each rank took to import them. The server itself runs
    no task."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["petra_ds", *EXAMPLE_IMPORTS])
    return ctx


class World:
    """``size`` worker processes, one per rank."""

    def __init__(self, size: int) -> None:
        ctx = context()
        self.size = size
        self.tasks = 0
        self.conns, self.procs = [], []
        for rank in range(size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, size, theirs, os.getpid()),
                               name=f"pool-rank{rank}-of-{size}")
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, target: Callable[[dict], Any], spec: dict, timeout: float, grace: float | None) -> list[dict]:
        """Outcomes by rank, as :func:`petra_ds.tools.spawn.run_processes` reports them (``result`` or
        ``error``); the caller kills the world when one failed."""
        self.tasks += 1
        task = (target, spec, free_port(), dict(os.environ), os.getcwd())
        for conn in self.conns:
            conn.send(task)
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        pending = set(range(self.size))
        while pending and time.monotonic() < deadline:
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout=max(0.0, deadline - time.monotonic()))
            for r in sorted(pending):
                conn, proc = self.conns[r], self.procs[r]
                if conn in ready or proc.sentinel in ready:
                    try:
                        replies[r] = conn.recv() if conn.poll() else ("error", None)
                    except (EOFError, OSError):
                        replies[r] = ("error", None)
                    if replies[r] == ("error", None):
                        proc.join(1)
                        replies[r] = ("error", f"no result (the pool's rank process exited, code {proc.exitcode})")
                    pending.discard(r)
                    if replies[r][0] != "ok" and grace is not None:
                        deadline = min(deadline, time.monotonic() + grace)
        outcomes = []
        for r in range(self.size):
            status, payload = replies.get(r, ("error", f"no result (still running after {timeout:g} s)"))
            if status == "ok":
                outcomes.append({"rank": r, "result": torch.load(io.BytesIO(payload), weights_only=False)})
            else:
                outcomes.append({"rank": r, "error": payload})
        return outcomes

    def close(self) -> None:
        """Kill every rank (they hold nothing worth a graceful exit, which takes seconds with torch)."""
        for conn, proc in zip(self.conns, self.procs):
            conn.close()
            proc.kill()
        for proc in self.procs:
            proc.join()


_worlds: dict[int, World] = {}
_lock = threading.Lock()


def _log(world_size: int, started: bool, failed: bool, seconds: float, target: Callable) -> None:
    """One line per task to ``$PETRA_DS_TEST_POOL_LOG``, if set (which worlds a session uses, and how)."""
    path = os.environ.get("PETRA_DS_TEST_POOL_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{world_size} {'new' if started else 'reused'} {'failed' if failed else 'ok'} {seconds:.2f} "
                    f"{target.__module__}.{target.__qualname__} {os.environ.get('PYTEST_CURRENT_TEST', '')}\n")


def launch(spec: dict[str, Any], world_size: int, timeout: float = 300, grace: float | None = None, *,
           target: Callable[[dict], Any]) -> list[Any]:
    """``target(spec)`` on every rank of a pooled world of ``world_size`` processes (fresh processes when
    the pool is off); the results by rank, or a RuntimeError with every failed rank's traceback."""
    if not enabled():
        return spawn.launch(spec, world_size, timeout, grace, target=target)
    with _lock:
        world = _worlds.pop(world_size, None)
        if world is not None and (not world.alive() or world.tasks >= MAX_TASKS):
            world.close()
            world = None
        started = world is None
        if started:
            while _worlds and sum(_worlds) + world_size > MAX_PROCESSES:
                _worlds.pop(next(iter(_worlds))).close()  # the least recently used
            world = World(world_size)
        begun = time.monotonic()
        try:
            outcomes = world.run(target, spec, timeout, grace)
        except BaseException:
            world.close()
            raise
        failed = any("error" in o for o in outcomes)
        if failed:
            world.close()
        else:
            _worlds[world_size] = world
        _log(world_size, started, failed, time.monotonic() - begun, target)
    return spawn.raise_failures(outcomes)


def restart(world_size: int) -> None:
    """Stop the world of ``world_size`` processes, if any: the next launch of that size starts a new one."""
    with _lock:
        world = _worlds.pop(world_size, None)
        if world is not None:
            world.close()


def shutdown() -> None:
    """Stop every world (the end of the session)."""
    with _lock:
        while _worlds:
            _worlds.popitem()[1].close()


atexit.register(shutdown)

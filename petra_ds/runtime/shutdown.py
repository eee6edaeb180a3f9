"""Ending a run's process groups while the interpreter is still whole.

A gloo process group owns C++ threads (a TCP loop and two work loops per group). When the last Python
reference to a group lives in a module global, the group is destroyed only while the interpreter is
being finalized, and its threads are joined then. A gloo worker thread that still holds a completed
operation drops that operation's tensors; a tensor whose Python object was already collected must take
the GIL to free it, and a thread that takes the GIL during finalization is ended with ``pthread_exit``,
whose forced unwinding through a ``noexcept`` C++ destructor calls ``std::terminate``: "terminate called
without an active exception", SIGABRT (exit -6, which the deepspeed launcher reports as 250), after all
the work is done. DeepSpeed keeps the grid of the last pipeline engine (with its four groups) in
``deepspeed.runtime.pipe.p2p``, so every pipeline run had live groups at exit.

:func:`shutdown` ends every group, lets go of that grid and collects it, so that the threads are joined
here, with the interpreter alive; :func:`communication_threads` names the gloo threads still running.
:func:`before_exit` lets a process that is about to end skip the interpreter's last collections.
"""

from __future__ import annotations

import gc
import os
import sys

from deepspeed import comm as ds_comm
from deepspeed.runtime.pipe import p2p
from torch import distributed as dist

#: the names gloo gives its threads (Linux truncates a thread's name to 15 characters)
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def shutdown() -> None:
    """Wait for every rank, end every process group (DeepSpeed's cached groups and mpu included) and free
    them, so that no communication thread outlives the program. Call it when no engine is referenced any
    more (an engine keeps its groups alive); the examples' ``run_main`` calls it after ``main`` returns.
    A peer that has already exited does not stop this rank from ending its groups. Does nothing when
    torch.distributed is not initialized."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except RuntimeError:  # a peer has already exited (a failed one reports its own failure): end ours anyway
        pass
    if ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
    p2p._grid = None  # the last PipelineEngine's grid, and with it its groups, kept at module level
    gc.collect()


def communication_threads() -> list[str]:
    """The gloo threads running in this process, by name (empty where /proc cannot tell: not Linux)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, tid, "comm")) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            continue
    return sorted(n for n in names if n.startswith(GLOO_THREADS))


def before_exit() -> None:
    """For a process whose work is done and that ends next: the interpreter's teardown collects garbage
    over every object torch, DeepSpeed and the run created (1.2-1.5 s of CPU per process on a 2-core VM,
    against 0.3 s once they are frozen). What was garbage is collected first; what is alive is frozen, so
    the teardown frees it by reference count alone. Never in a process that goes on working (a frozen
    object is never collected).

    Nothing is frozen where an extension built with nanobind is loaded (triton from 3.9, which torch 2.15
    installs and DeepSpeed's engine imports): it counts, at the very end, the objects of its own that the
    teardown left alive, and frozen cycles are never freed, so every process would end with some thirty lines
    of "nanobind: leaked ..." on stderr."""
    gc.collect()
    if not nanobind_loaded():
        gc.freeze()


def nanobind_loaded() -> bool:
    """Whether an extension module built with nanobind is loaded: one whose namespace holds a nanobind function
    or class (their types, ``nb_func`` and the metaclass ``nb_meta``, are nanobind's own and named ``nb_...``)."""
    for module in list(sys.modules.values()):
        if str(getattr(module, "__file__", None)).endswith((".so", ".pyd")) and any(
                type(value).__name__.startswith("nb_") for value in list(getattr(module, "__dict__", {}).values())):
            return True
    return False

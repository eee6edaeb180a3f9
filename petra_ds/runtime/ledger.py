"""Bytes held, counted in one place: by tensor (the ledger a PETRA stage keeps) and by distinct storage (what
the held-bytes tracker, ``petra_ds.diagnostics.held``, adds up).

``engine.memory_report()`` returns the ledger, read from the engine's public views; the tracker measures
the same :class:`petra_ds.runtime.observe.Holdings` view by storage, and the tests hold the two to each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from torch import Tensor

from ..util.nested import tensors_in

if TYPE_CHECKING:
    from .engine import PetraEngine

#: a storage's identity: (device, address of its first byte)
StorageKey = tuple[str, int]
#: the parts of :func:`stage_tensors` in host memory (offloaded), not on the stage's device
HOST_PARTS = ("fifo_host", "messages_host")


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor inside ``obj`` (nested), each tensor counted whole."""
    return sum(t.numel() * t.element_size() for t in tensors_in(obj))


def storage(t: Tensor) -> tuple[StorageKey, int]:
    """(identity, bytes) of the storage behind ``t``: views of one storage share it."""
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr()), s.nbytes()


def storage_bytes(obj: Any, seen: set[StorageKey]) -> int:
    """Bytes of the storages behind the tensors in ``obj`` not in ``seen`` (each once); adds them to ``seen``."""
    total = 0
    for t in tensors_in(obj):
        key, nbytes = storage(t)
        if key not in seen:
            seen.add(key)
            total += nbytes
    return total


def storage_keys(tensors: Iterable[Tensor]) -> set[StorageKey]:
    return {storage(t)[0] for t in tensors}


def stage_tensors(engine: PetraEngine, stage: int) -> dict[str, Any]:
    """The tensors behind each byte count of :func:`memory_report` for local stage ``stage``: parameters,
    gradients, optimizer state, the input buffer on the device, the host copies of its offloaded entries
    (``fifo_host``), the parameter buffer, stage 0's raw micro-batches, messages held, the host copies of its parked
    messages (``messages_host``), the static tensors of its CUDA graphs and the delay compensation's state. All on
    the stage's device but :data:`HOST_PARTS`."""
    st = engine.stages[stage]
    optimizer = engine.stage_optimizers[stage - engine.local_stage_ids[0]]
    state = {} if optimizer is None else optimizer.state
    held = engine.holdings(stage)
    return {"params": st.params, "grads": [p.grad for p in st.params if p.grad is not None],
            "optimizer_state": [list(s.values()) for s in state.values()], "input_buffer": held.inputs,
            "fifo_host": held.offloaded, "param_buffer": held.param_stash, "raw_micro_batches": held.data,
            "messages": held.messages, "messages_host": held.messages_host, "graphs": held.graphs,
            "delay_compensation": st.compensation.state_dict()}


def memory_report(engine: PetraEngine) -> dict[int, dict[str, int]]:
    """Per local stage, bytes held now, by :func:`stage_tensors`' parts, with the input and parameter buffers'
    peaks and the micro-batches in the input buffer and in host memory."""
    report = {}
    for j, st in engine.stages.items():
        parts = stage_tensors(engine, j)
        bytes_ = {name: tensor_bytes(tensors) for name, tensors in parts.items()}
        report[j] = {**bytes_, "input_buffer_peak": st.peak_input_bytes,
                     "input_buffer_micro_batches": len(parts["input_buffer"]),
                     "fifo_host_micro_batches": len(parts["fifo_host"]),
                     "param_buffer_peak": st.peak_param_buffer_bytes,
                     "graph_pools": sum(graphed.pool_bytes for graphed in st.graphed)}
    return report

"""The memory ledger: bytes a PETRA stage holds, counted from the engine's public views.

``engine.memory_report()`` returns this; the held-bytes tracker (``petra_ds.analysis.held``) measures
the same :class:`petra_ds.observe.Holdings` view by storage, and the tests hold the two to each other.
"""

from __future__ import annotations

from typing import Any

from .stage import tensor_bytes


def memory_report(engine: Any) -> dict[int, dict[str, int]]:
    """Per local stage, bytes held now: parameters, gradients, optimizer state, input buffer (now and
    peak), parameter buffer (now and peak), stage 0's raw micro-batches, messages held, the delay
    compensation's state (weight prediction's averaged update)."""
    report = {}
    for j, st in engine.stages.items():
        optimizer = engine.stage_optimizers[j - engine.local_stage_ids[0]]
        state = {} if optimizer is None else optimizer.state
        held = engine.holdings(j)
        report[j] = {
            "params": tensor_bytes(st.params),
            "grads": tensor_bytes([p.grad for p in st.params if p.grad is not None]),
            "optimizer_state": sum(tensor_bytes(list(s.values())) for s in state.values()),
            "input_buffer": tensor_bytes(held.inputs),
            "input_buffer_peak": st.peak_input_bytes,
            "input_buffer_micro_batches": len(held.inputs),
            "param_buffer": tensor_bytes(held.param_stash),
            "param_buffer_peak": st.peak_param_buffer_bytes,
            "raw_micro_batches": tensor_bytes(held.data),
            "messages": tensor_bytes(held.messages),
            "delay_compensation": tensor_bytes(st.compensation.state_dict()),
        }
    return report

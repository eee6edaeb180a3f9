"""The Tab. 3 estimate (petra_ds.perf.memory_estimate) against the engine's own ledger of what it holds."""

import pytest
import torch

from petra_ds.perf import memory_estimate as memory
from petra_ds.tools.toy import toy_layer_specs

from harness import launch

SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}


@pytest.mark.parametrize("stores_inputs,stores_params", [(True, True), (False, False)])
def test_estimate_equals_the_buffers_the_engine_holds_in_steady_state(stores_inputs, stores_params):
    """One stage per toy layer (J = 9), float64, micro-batch 4: between two clocks of the full pipeline
    the engine holds exactly the estimate's input and parameter buffers (stage 0's data excluded)."""
    J, k, batches = 9, 2, 9
    petra = {"input_buffer": "all" if stores_inputs else "non_reversible", "param_buffer": stores_params}
    (result,) = launch({"pipe": 1, "stages_per_rank": J, "k": k, "train_batches": batches, "optimizer": SGD,
                        "memory_trace": True, "capture_grads": False, "drain": False, "petra": petra})
    torch.set_default_dtype(torch.float64)
    stages = memory.stage_memory([spec.build() for spec in toy_layer_specs()], (6,), micro_batch=4, bytes_per_value=8)
    assert [s.reversible for s in stages] == [False, True, False, True, True, True, False, True, False]
    expected = memory.estimate(stages, stores_inputs, stores_params)
    steady = [report for clock, report in result["memory"] if 2 * (J - 1) <= clock < k * batches - 1]
    assert steady
    for report in steady:
        assert sum(e["input_buffer"] for e in report.values()) == expected["input_buffer"]
        assert sum(e["param_buffer"] for e in report.values()) == expected["param_buffer"]
        assert sum(e["params"] for e in report.values()) == expected["model"]


def test_table3_rows_are_ordered_like_the_paper_and_savings_follow():
    stages = memory.revnet_stages(depth=18, image=32, micro_batch=2, base_width=4)
    rows = memory.table3(stages)
    assert [(r["stores_inputs"], r["stores_params"]) for r in rows] == list(memory.PAPER_TAB3)
    assert rows[0]["saving_pct"] == 0
    assert rows[0]["total_gb"] > rows[1]["total_gb"] > rows[2]["total_gb"] > rows[3]["total_gb"] > 0

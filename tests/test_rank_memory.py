"""The per-rank memory model (petra_ds.diagnostics.rank_memory) against the engine's ledger of what each stage holds."""

import pytest
import torch

from petra_ds.models.revnet import revnet_layers
from petra_ds.diagnostics import rank_memory

from harness import launch

SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_the_held_bytes_the_model_predicts_are_the_engines_for_revnet18_on_ten_stages(offload):
    """RevNet18 (width 4, 8 x 8 images, micro-batch 2, float64) with one stage per layer, J = 10, in one process:
    at every clock end once every stage has stepped, each stage's parameters, optimizer state, FIFO or raw micro-batches
    on the device, and messages are the bytes the model computes from one micro-batch through the layers;
    the gradients are there or not (set to None after a step). Offloaded entries are the host's."""
    J, k, batches, micro_batch = 10, 4, 7, 2
    spec = {"model": "revnet", "pipe": 1, "stages_per_rank": J, "k": k, "train_batches": batches,
            "micro_batch": micro_batch, "optimizer": SGD, "dropout": 0.0, "memory_trace": True,
            "capture_grads": False, "drain": False, "petra": {"fifo_offload": offload}}
    (result,) = launch(spec)
    torch.set_default_dtype(torch.float64)
    layers = [s.build() for s in revnet_layers(18, 10, cifar=True, base_width=4)]
    stages = rank_memory.measure_stages(layers, torch.randn(micro_batch, 3, 8, 8),
                                        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    rows = rank_memory.rank_peaks(stages, labels=micro_batch * 8)
    assert [j for j, r in enumerate(rows) if r["fifo"]] == [0, 3, 5, 7]  # the data, the three downsampling blocks
    stepped = 2 * (J - 1) + k  # every stage has its optimizer state
    steady = [report for clock, report in result["memory"] if stepped <= clock < k * batches - 1]
    assert len(steady) >= 5
    for report in steady:
        for s, row in zip(stages, rows, strict=True):
            held = report[s.index]
            assert held["params"] == s.params and held["optimizer_state"] == s.optimizer_state
            assert held["grads"] in (0, s.params)
            device_fifo = held["input_buffer"] + held["raw_micro_batches"]
            assert device_fifo == row["fifo_offloaded" if offload == "cpu" else "fifo"], (s.index, held)
            assert held["fifo_host"] == (row["fifo"] - row["fifo_offloaded"] if offload == "cpu" else 0)
            assert held["messages"] == row["messages"], (s.index, held)


def test_a_rank_holds_its_stash_per_micro_batch_in_flight_under_1f1b_and_its_fifo_under_petra():
    """The peaks' arithmetic on made-up stages: J = 4, stage 2 keeps a FIFO (not reversible), stage 1 reconstructs."""
    def stage(j, reversible):
        return rank_memory.StageBytes(j, "layer", reversible, params=10, optimizer_state=10, input=100, output=100,
                                      stash=1000, workspace=500)

    rows = rank_memory.rank_peaks([stage(0, False), stage(1, True), stage(2, False), stage(3, False)], labels=1)
    assert [r["fifo"] for r in rows] == [600, 0, 200, 0]  # tau = 6, 4, 2, 0 inputs; stage 1 keeps none
    assert [r["fifo_offloaded"] for r in rows] == [100, 0, 100, 0]  # the head, stage 0's data as a FIFO's inputs
    assert [r["messages"] for r in rows] == [100, 301, 201, 101]  # stage 1 receives its output back to invert
    assert [r["1f1b"] for r in rows] == [30 + 3000 + 500, 30 + 2000 + 500, 30 + 1000 + 500, 30 + 500]
    assert [r["petra"] for r in rows] == [30 + 600 + 100 + 500, 30 + 301 + 500, 30 + 200 + 201 + 500, 30 + 101 + 500]
    assert rows[2]["petra_offload"] == 30 + 100 + 100 + 201 + 500  # the head, and the entry being copied out
    assert rows[0]["petra_offload"] == 30 + 100 + 100 + 100 + 500

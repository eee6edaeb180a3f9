"""Data parallelism with reconstruction: 2 replicas x J = 4 stages (a reversible middle stage), dropout and
batch norm inside the couplings. Replicas draw different dropout masks (the keyed-RNG key includes the
replica), each replica's reconstruction replays its own masks, and the replicas stay equal: parameters
(gradients are averaged) and batch-norm running statistics (averaged with them)."""

import functools

import torch

from harness import launch

SPEC = dict(pipe=1, dp=2, stages_per_rank=4, k=2, micro_batch=4, train_batches=3, dropout=0.3, batchnorm=True,
            track_reconstruction=True, probe="probes:replica_view")


@functools.lru_cache(maxsize=None)
def run(lr: float) -> tuple:
    """The two replicas' results (one launch per learning rate, shared by the tests)."""
    results = launch({**SPEC, "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}}})
    return tuple(sorted(results, key=lambda r: r["rank"]))


def test_replicas_draw_different_masks_and_reconstruct_exactly_at_lr0():
    a, b = run(0.0)
    assert a["reconstructs"] == b["reconstructs"] == {0: False, 1: True, 2: False, 3: False}
    for result in (a, b):
        errors = result["reconstruction_errors"][1]
        assert len(errors) == SPEC["k"] * SPEC["train_batches"]  # every micro-batch, drained
        assert max(errors) < 1e-13, errors  # float64 rounding: each replica replays its own masks
    # the same input through the same weights: only the masks differ between the replicas
    for j in (0, 1):
        outputs = zip(a["probe"][j]["output"], b["probe"][j]["output"])
        assert any(not torch.allclose(x, y) for x, y in outputs), j


def test_replicas_stay_equal_while_training():
    a, b = run(0.1)
    assert a["params"].keys() == b["params"].keys()
    moved = False
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), name
    for name, value in run(0.0)[0]["params"].items():
        moved |= not torch.equal(value, a["params"][name])
    assert moved  # lr 0.1 trained: equality is not the untouched initialisation
    for j in range(4):
        for x, y in zip(a["probe"][j]["running_stats"], b["probe"][j]["running_stats"]):
            assert torch.equal(x, y), j
    assert any(a["probe"][j]["running_stats"] for j in range(4))

"""What a stage's optimizer step needs besides the optimizer: the data-parallel average and the
non-finite checks of ``petra.non_finite``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def average_over_replicas(tensors: list[Tensor], transport: Any, group: Any, what: str) -> None:
    """One all-reduce inside the stage's data-parallel ``group``: the accumulated gradients, and the
    batch-norm running statistics, so every replica evaluates with the same ones (each replica's
    reconstructions updated them from its own micro-batches)."""
    floats = [t for t in tensors if t.is_floating_point()]
    if not floats:
        return
    flat = _flatten_dense_tensors(floats)
    transport.all_reduce(flat, group, what)
    flat /= torch.distributed.get_world_size(group)
    for t, synced in zip(floats, _unflatten_dense_tensors(flat, floats)):
        t.copy_(synced)


def check_losses(pending: list[tuple[int, int, Tensor]]) -> None:
    """``non_finite: "raise"``: one host sync for the ``(stage, micro-batch, loss)`` since the last check,
    at the last stage's optimizer step (before the gradients they poisoned are looked at) or the window's
    end, instead of one per micro-batch."""
    if not pending:
        return
    finite = torch.stack([torch.isfinite(loss) for _, _, loss in pending]).tolist()
    for (stage, m, loss), ok in zip(pending, finite):
        if not ok:
            raise FloatingPointError(
                f"non-finite loss {loss.item()} at stage {stage}, micro-batch {m}, clock {m + stage}; fix "
                'the data or the learning rate, or set "petra": {"non_finite": "skip"} to skip the updates '
                "it poisons")


def gradients_finite(params: list[Tensor], where: str, non_finite: str) -> bool:
    """One check per step (not per micro-batch): are the k accumulated gradients finite? With
    ``non_finite: "raise"`` a non-finite one raises before the optimizer could write NaN."""
    if not params or bool(torch.stack([torch.isfinite(p.grad).all() for p in params]).all()):
        return True
    if non_finite == "raise":
        raise FloatingPointError(f'non-finite gradient at {where}; set "petra": {{"non_finite": "skip"}} to skip '
                                 "such updates")
    return False

"""What a stage's optimizer step needs besides the optimizer: the data-parallel average and the
accumulated gradients' non-finite check of ``petra.non_finite`` (the per-value checks: ``petra_ds.finite``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .nn.check import NonFiniteError


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


def gradients_finite(params: list[Tensor], where: str, non_finite: str, earlier: Callable[[], None]) -> bool:
    """One check per step (not per micro-batch): are the k accumulated gradients finite? With
    ``non_finite: "raise"`` a non-finite one raises before the optimizer could write NaN, after ``earlier()``
    (``FiniteWatch.check``) has raised for the value that went non-finite first, if it saw one."""
    if not params or bool(torch.stack([torch.isfinite(p.grad).all() for p in params]).all()):
        return True
    if non_finite == "raise":
        earlier()
        raise NonFiniteError(
            f"non-finite gradient at {where}, no earlier NaN or Inf seen on this rank: it came in with the "
            "data-parallel average or a tied weight's gradient (another rank's NonFiniteError names its origin), "
            'or "check_finite" is off. Set "petra": {"non_finite": "skip"} to skip such updates', kind="gradient")
    return False

"""A checkpoint's in-flight state resumed on another data-parallel degree, with the global batch kept.

D replicas feed micro-batch m as D contiguous slices of one global micro-batch: replica r holds its rows
r*b .. (r+1)*b - 1. Resumed on D' replicas of b' = b*D/D' rows each, replica r' holds the rows of old
replicas r'*D/D' .. (r'+1)*D/D' - 1 (D' divides D), or part r' mod (D'/D) of old replica r' // (D'/D)
(D divides D'). So every batch-shaped tensor in flight (input FIFO entries, stage 0's micro-batches,
activations and gradients received for the next clock) is joined or cut along its first dimension, and
the accumulated gradients, each a replica's mean over its own rows, are averaged over the replicas
joined (or copied into each part: the step's average over replicas then takes the same mean). A gradient
in flight (delta_j, received for the next clock) is that of a loss averaged over its micro-batch's rows,
so it is scaled by the old rows over the new, as with a mean-reduced loss data parallelism already
assumes (a mean of the replicas' means is the mean over the global micro-batch). The rest
of a stage is the same on every replica (optimizer and scheduler state, stashed weights, compensation,
tied gradients, already averaged over replicas): replica 0's is kept.

The arithmetic is the same up to the order of reductions (one mean over 2b rows against the mean of two
means over b). Keyed random draws keep going by the row blocks of the run's first degree (:func:`row_blocks`,
``nn/row_draws.py``), so dropout masks are the same. A batch norm in training mode, though, normalises over
the rows of its own micro-batch: with one, the run resumed is another run (stated where resuming is
documented).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..nn.rng import RowBlocks
from ..schedule import channels
from ..util.nested import map_tensors, tensors_in
from .fifo import saved_entries

#: message kinds whose payload is rows of the micro-batch (the others, tied weights' gradients, are not)
BATCH_MESSAGES = (channels.ACT, channels.GRAD, channels.DATA)


def sources(replica: int, written: int, ours: int) -> tuple[list[int], int, int]:
    """(the old replicas whose rows replica ``replica`` of ``ours`` holds, which part of them, of how many
    parts): joined when ``ours`` divides ``written``, cut when ``written`` divides ``ours``."""
    if written % ours == 0:
        group = written // ours
        return list(range(replica * group, (replica + 1) * group)), 0, 1
    if ours % written == 0:
        parts = ours // written
        return [replica // parts], replica % parts, parts
    raise ValueError(f"a checkpoint of {written} data-parallel replicas resumes on a number of replicas that "
                     f"divides it or that it divides, not {ours}")


def row_blocks(replica: int, blocks: int, ours: int) -> RowBlocks:
    """The row blocks replica ``replica`` of ``ours`` holds in a run whose keyed draws go by ``blocks`` blocks (its
    first data-parallel degree): its dropout masks are those the replicas of that degree drew for its rows."""
    try:
        olds, part, parts = sources(replica, blocks, ours)
    except ValueError:
        raise ValueError(f"this run's random draws are keyed by {blocks} row blocks of the global micro-batch (the "
                         f"data-parallel degree it started with): {ours} replicas can neither join nor cut them. "
                         f"Resume on a number of replicas that divides {blocks} or that {blocks} divides") from None
    return RowBlocks(olds[0], len(olds), part, parts)


def regroup(states: list[dict[str, Any]], part: int, parts: int) -> dict[str, Any]:
    """One stage's state (``LocalStages.stage_state`` with its optimizer, scheduler and inbox) for a replica
    holding the rows of ``states``' replicas joined, then part ``part`` of ``parts``."""
    first = states[0]
    own = first["state"]
    entries = {}
    for name in ("fifo", "raw"):
        tables = [dict(saved_entries(s["state"][name])) for s in states]
        entries[name] = [(m, _cut(_join([t[m] for t in tables]), part, parts)) for m in tables[0]]
    inbox = {key: (_cut(_join([s["inbox"][key] for s in states]), part, parts)
                   if key[1] in BATCH_MESSAGES else value) for key, value in first["inbox"].items()}
    share = len(states) / parts  # rows now per row before: each row's share of its micro-batch's mean falls by it
    for key in inbox:
        if key[1] == channels.GRAD:  # (delta, x~): delta is the gradient of that mean
            delta, *rest = inbox[key]
            inbox[key] = (map_tensors(lambda t: t / share, delta), *rest)
    grads = [_mean(list(g)) for g in zip(*(s["state"]["grads"] for s in states))]
    state = {**own, **entries, "grads": grads, "peak_input_bytes": int(own["peak_input_bytes"] * share)}
    return {**first, "state": state, "inbox": inbox}


def _mean(grads: list[Tensor | None]) -> Tensor | None:
    """The replicas' accumulated gradients of one parameter, averaged."""
    if all(g is None for g in grads):
        return None
    if any(g is None for g in grads):
        raise ValueError("the replicas of a stage disagree on which parameters hold a gradient")
    return grads[0] if len(grads) == 1 else torch.stack(grads).mean(0)


def _join(values: list[Any]) -> Any:
    """The replicas' values of one batch-shaped message or entry as one, rows in replica order."""
    columns = zip(*(list(tensors_in(v)) for v in values))
    joined = iter([torch.cat(c) if c[0].dim() > 0 else c[0] for c in columns])
    return map_tensors(lambda _: next(joined), values[0])


def _cut(value: Any, part: int, parts: int) -> Any:
    """Rows ``part`` of ``parts`` of a batch-shaped value."""
    def rows(t: Tensor) -> Tensor:
        if t.dim() == 0 or parts == 1:
            return t
        if t.shape[0] % parts:
            raise ValueError(f"a tensor of {t.shape[0]} rows cannot be cut into {parts} replicas' parts")
        return t.chunk(parts)[part].clone()

    return map_tensors(rows, value)

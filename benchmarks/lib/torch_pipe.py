"""torch.distributed.pipelining's schedules as PETRA's peers: the same layers cut into pipeline stages
and run by torch's own ``PipelineStage`` and schedule classes (used by ``throughput.py`` and
``time_to_loss.py``).

A variant is a schedule name, plus ``_ckpt`` for torch's non-reentrant activation checkpointing of every
block. The layers travel with their two streams stacked into one tensor (``throughput.Packed``), the
form DeepSpeed's baselines get too. Schedules with two stages per rank cut the layers into 2J chunks,
interleaved (chunk v on rank v mod J) or V-shaped (chunks r and 2J-1-r on rank r). Every cut balances
the schedule's own cost: ``petra_ds.pipeline.partition`` rule ``backprop`` or ``backprop_ckpt`` when layer costs
are given, else DeepSpeed's rule named by ``partition_method`` over the chunks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from petra_ds.perf.torch_programs import placement, schedule_of
from petra_ds.perf.torch_programs import TORCH_VARIANTS

#: the benchmark's names for torch's schedules: the timeline model's
VARIANTS = TORCH_VARIANTS
#: the first torch whose schedules open without a message from a stage to a neighbour on its own rank: before it,
#: every stage sends one to each neighbour, and gloo cannot send to its own rank (torch 2.11: "Pair is not
#: connected"); torch 2.12 opens with its forward / backward vote instead (2.12.1 and 2.14.1 run every variant here)
OPENS_WITHOUT_SELF_SENDS = (2, 12)


def unsupported(variant: str, ranks: int, backend: str) -> str | None:
    """Why this torch cannot run ``variant`` on ``ranks`` processes over ``backend``, or None when it can."""
    where = placement(variant, ranks)
    if backend != "gloo" or not any(where[v] == where.get(v + 1) for v in where):
        return None
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= OPENS_WITHOUT_SELF_SENDS:
        return None
    return (f"torch {torch.__version__}'s {variant} opens with a message from each chunk to its neighbours, one on "
            "the same rank included, which gloo cannot send; run it with torch >= 2.12 (2.12.1 and 2.14.1 tested) or "
            "choose another schedule")


def local_chunks(variant: str, rank: int, ranks: int) -> list[int]:
    """The chunk (virtual stage) indices rank ``rank`` runs, in torch's placement (named once, with the
    schedules: ``petra_ds.perf.torch_programs``, the timeline model of the same schedules)."""
    return [v for v, r in sorted(placement(variant, ranks).items()) if r == rank]


def chunk_parts(num_layers: int, chunks: int, *, costs: Sequence | None, checkpointed: bool,
                method: str, block_pattern: str, layer_names: Sequence[str]) -> list[int]:
    """Layer boundaries of ``chunks`` contiguous chunks, balanced for a backprop schedule."""
    from deepspeed.runtime import utils as ds_utils

    from petra_ds.pipeline.partition import balanced_parts

    if costs is not None:
        return balanced_parts(costs, chunks, rule="backprop_ckpt" if checkpointed else "backprop")
    if method == "uniform":
        return [int(p) for p in ds_utils.partition_uniform(num_layers, chunks)]

    weights = [1 if re.search(block_pattern, name, re.IGNORECASE) else 0 for name in layer_names]
    return [int(p) for p in ds_utils.partition_balanced(weights, chunks)]


class Chunk(nn.Module):
    """Consecutive layers of one pipeline stage; with ``checkpointed`` every block runs under torch's
    non-reentrant checkpoint (it keeps only the block's input for the backward)."""

    def __init__(self, layers: Sequence[nn.Module], blocks: Sequence[bool], checkpointed: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.checkpointed = [checkpointed and b for b in blocks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, ckpt in zip(self.layers, self.checkpointed):
            x = checkpoint(layer, x, use_reentrant=False) if ckpt else layer(x)
        return x


@dataclass
class Peer:
    """One rank's part of a torch pipeline: its schedule, its chunk modules and their indices, every
    chunk's layer boundaries, and whether it holds the first chunk (feeds the data) or the last (computes
    the loss)."""

    schedule: Any
    modules: list[nn.Module]
    chunks: list[int]
    parts: list[int]
    first: bool
    last: bool

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def step(self, optimizer: torch.optim.Optimizer, x: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """One optimizer step over the schedule's micro-batches (``x`` and ``labels`` hold all of them);
        the micro-batches' losses on the rank with the last chunk."""
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses} if self.last else {}
        self.schedule.step(*([x] if self.first else []), **kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return losses


def build(variant: str, specs: Sequence, loss_fn: Callable, micro_batches: int, device: torch.device, *,
          costs: Sequence | None, method: str, block_pattern: str, seed: int) -> Peer:
    """This rank's :class:`Peer` for ``variant`` on the default process group, one pipeline rank per
    process."""

    from torch import distributed as dist
    from torch.distributed import pipelining

    cls_name, per_rank, _, checkpointed = schedule_of(variant)
    ranks, rank = dist.get_world_size(), dist.get_rank()
    reason = unsupported(variant, ranks, dist.get_backend())
    if reason is not None:
        raise RuntimeError(reason)
    chunks = ranks * per_rank
    names = [spec.typename.__name__ for spec in specs]
    parts = chunk_parts(len(specs), chunks, costs=costs, checkpointed=checkpointed, method=method,
                        block_pattern=block_pattern, layer_names=names)
    local = local_chunks(variant, rank, ranks)
    modules, stages = [], []
    for index in local:
        torch.manual_seed(seed + index)
        a, b = parts[index], parts[index + 1]
        blocks = [bool(re.search(block_pattern, name)) for name in names[a:b]]
        module = Chunk([spec.build(log=False) for spec in specs[a:b]], blocks, checkpointed).to(device)
        modules.append(module)
        stages.append(pipelining.PipelineStage(module, index, chunks, device))
    schedule = getattr(pipelining, cls_name)(stages[0] if per_rank == 1 else stages, micro_batches, loss_fn=loss_fn)
    return Peer(schedule, modules, local, parts, first=0 in local, last=chunks - 1 in local)

"""Dropout drawn by row blocks, for a replica that holds several replicas' rows or part of one's.

After a run resumes on another data-parallel degree, a replica's micro-batch is the rows of several old
replicas joined, or part of one old replica's rows (``runtime/replicas.py``). For the run to continue on
the same masks, each old replica's rows must draw what that replica would have drawn: the same key, the
same shape. :class:`SplitDraws` does that for the ops that draw per row: each dropout function of torch and
``scaled_dot_product_attention`` with ``dropout_p`` run once per row block on that block's rows and
stream, or, for part of a block, on the whole block's shape (the replica's rows repeated to fill it) with
the replica's part kept. Rows are independent in these ops, so the rows kept are those of the
uninterrupted run. It is active only inside such a replica's keyed scopes (``rng.micro_batch_rng``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from .rng import BlockDraws

#: torch's dropout functions (input, p, training, inplace) and their ATen forms (input, p, train)
_DROPOUTS = {F.dropout: True, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True, F.alpha_dropout: True,
             F.feature_alpha_dropout: True, torch.dropout: False, torch.alpha_dropout: False,
             torch.feature_dropout: False, torch.feature_alpha_dropout: False}


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


class SplitDraws(TorchFunctionMode):
    """Runs the row-wise random ops of the keyed scope ``current()`` returns by its row blocks."""

    def __init__(self, current: Callable[[], BlockDraws | None]) -> None:
        super().__init__()
        self.current = current

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        draws = self.current()
        if draws is not None:
            if func in _DROPOUTS:
                functional = _DROPOUTS[func]
                p = _argument(args, kwargs, 1, "p", 0.5)
                training = _argument(args, kwargs, 2, "training" if functional else "train", True)
                if training and p > 0:
                    return _dropout(draws, func, args, kwargs, functional)
            elif func is F.scaled_dot_product_attention and _argument(args, kwargs, 4, "dropout_p", 0.0) > 0:
                return _attention(draws, func, args, kwargs)
        return func(*args, **kwargs)


def _dropout(draws: BlockDraws, func: Callable, args: tuple, kwargs: dict, functional: bool) -> Tensor:
    x, rest = args[0], args[1:]
    inplace = functional and _argument(args, kwargs, 3, "inplace", False)
    if inplace:
        rest, kwargs = rest[:2], {k: v for k, v in kwargs.items() if k != "inplace"}
    out = by_rows(draws, lambda rows: func(rows[0], *rest, **kwargs), [x], len(x))
    return x.copy_(out) if inplace else out


def _attention(draws: BlockDraws, func: Callable, args: tuple, kwargs: dict) -> Tensor:
    q, k, v, *rest = args
    mask = rest[0] if rest else kwargs.get("attn_mask")
    batch = len(q)
    split = [q, k, v]
    per_row = isinstance(mask, Tensor) and mask.dim() == q.dim() and mask.shape[0] == batch > 1
    if per_row:
        split.append(mask)

    def attend(rows: list[Tensor]) -> Tensor:
        if not per_row:
            return func(*rows, *rest, **kwargs)
        if rest:
            return func(*rows, *rest[1:], **kwargs)
        return func(*rows[:3], **{**kwargs, "attn_mask": rows[3]})

    return by_rows(draws, attend, split, batch)


def by_rows(draws: BlockDraws, op: Callable[[list[Tensor]], Tensor], tensors: list[Tensor], batch: int) -> Tensor:
    """``op`` on ``tensors`` (their first dimension: the replica's ``batch`` rows), one row block at a time on
    its own stream, outputs joined by rows; for part of a block, on the block's shape with the part kept."""
    rows = draws.rows
    if rows.parts == 1:
        if batch % rows.count:
            raise ValueError(f"a micro-batch of {batch} rows cannot be split into {rows.count} replicas' row blocks")
        n = batch // rows.count
        return torch.cat([draws.run(i, lambda i=i: op([t[i * n:(i + 1) * n] for t in tensors]))
                          for i in range(rows.count)])
    whole = draws.run(0, lambda: op([torch.cat([t] * rows.parts) for t in tensors]))
    return whole[rows.part * batch:(rows.part + 1) * batch]

"""Stage 0's data: reading one micro-batch, moving it to the device, keeping its shapes fixed."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from torch import Tensor

from . import messages


def to_device(value: Any, device: Any) -> Any:
    """Tensors (inside tuples and lists) moved to ``device``; anything else as it is."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return tuple(to_device(v, device) for v in value)
    return value


def read_micro_batch(data: Iterator | None, batch_fn: Callable | None, device: Any,
                     ran_out: str) -> tuple[Any, Any]:
    """The next ``(inputs, labels)`` of ``data`` on ``device``; ``ran_out`` says what to do when the
    iterator is exhausted."""
    if data is None:
        raise ValueError("no data iterator: pass one to train_batch()")
    try:
        batch = next(data)
    except StopIteration:
        raise ValueError(ran_out) from None
    if batch_fn is not None:
        batch = batch_fn(batch)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError("the data iterator must yield (inputs, labels) pairs, as for DeepSpeed's pipeline")
    return to_device(batch[0], device), to_device(batch[1], device)


def check_layout(first: messages.Layout | None, batch: tuple[Any, Any], micro_batch: int) -> messages.Layout:
    """The layout of training's micro-batches, fixed by the first one: PETRA exchanges shapes once."""
    layout = messages.layout_of(batch)
    if first is not None and layout != first:
        raise messages.MessageLayoutError(
            f"micro-batch {micro_batch} has layout {messages.describe(layout)} but the first one had "
            f"{messages.describe(first)}; PETRA exchanges shapes once: keep the micro-batch size fixed "
            "(e.g. DataLoader(drop_last=True))")
    return first or layout

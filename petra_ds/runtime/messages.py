"""What travels between stages, flattened for point-to-point transport.

A message is a tuple of fields; a field is ``None``, a tensor, or a tuple of tensors-or-``None``
(an activation pair, a delta with no entry for integer inputs). The receiver must allocate buffers
before the data arrives, so the layout (dtypes and shapes) of each channel is sent once, as a
fixed-size integer header, and every later message on that channel must match it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from ..util.nested import map_tensors, tensors_in

HEADER_LEN = 512

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]
_DTYPE_ID = {dtype: i for i, dtype in enumerate(_DTYPES)}

# item: None or (dtype, shape); field: None, ("tensor", item) or ("tuple", (item, ...))
Item = Optional[tuple[torch.dtype, tuple[int, ...]]]
Layout = tuple[Any, ...]


class MessageLayoutError(ValueError):
    """A message that does not match the layout negotiated for its channel."""


def _item(t: Tensor | None) -> Item:
    return None if t is None else (t.dtype, tuple(t.shape))


def layout_of(fields: Sequence[Any]) -> Layout:
    out = []
    for field in fields:
        if field is None:
            out.append(None)
        elif isinstance(field, Tensor):
            out.append(("tensor", _item(field)))
        else:
            out.append(("tuple", tuple(_item(t) for t in field)))
    return tuple(out)


def flatten(fields: Sequence[Any]) -> list[Tensor]:
    """The tensors of a message, in layout order, contiguous."""
    return [t.detach().contiguous() for t in tensors_in(fields)]


def allocate(layout: Layout, device: torch.device) -> list[Tensor]:
    """Empty receive buffers for a message of ``layout``."""
    return [torch.empty(shape, dtype=dtype, device=device)
            for field in layout if field is not None
            for item in ((field[1],) if field[0] == "tensor" else field[1]) if item is not None
            for dtype, shape in (item,)]


def unflatten(tensors: Sequence[Tensor], layout: Layout) -> tuple[Any, ...]:
    it = iter(tensors)
    fields = []
    for field in layout:
        if field is None:
            fields.append(None)
        elif field[0] == "tensor":
            fields.append(next(it))
        else:
            fields.append(tuple(None if item is None else next(it) for item in field[1]))
    return tuple(fields)


def encode(layout: Layout) -> Tensor:
    """The layout as an int64 header of ``HEADER_LEN`` entries."""
    ints: list[int] = [len(layout)]

    def item(i: Item) -> None:
        if i is None:
            ints.append(-1)
        else:
            ints.extend([_DTYPE_ID[i[0]], len(i[1]), *i[1]])

    for field in layout:
        if field is None:
            ints.append(-1)
        elif field[0] == "tensor":
            ints.append(0)
            item(field[1])
        else:
            ints.extend([1, len(field[1])])
            for i in field[1]:
                item(i)
    if len(ints) + 1 > HEADER_LEN:
        raise MessageLayoutError(f"message layout needs {len(ints) + 1} header entries, more than {HEADER_LEN}")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = len(ints)
    header[1:len(ints) + 1] = torch.tensor(ints, dtype=torch.int64)
    return header


def decode(header: Tensor) -> Layout:
    values = header.tolist()
    ints = iter(values[1:values[0] + 1])

    def item() -> Item:
        dtype_id = next(ints)
        if dtype_id == -1:
            return None
        ndim = next(ints)
        return _DTYPES[dtype_id], tuple(next(ints) for _ in range(ndim))

    fields = []
    for _ in range(next(ints)):
        kind = next(ints)
        if kind == -1:
            fields.append(None)
        elif kind == 0:
            fields.append(("tensor", item()))
        else:
            fields.append(("tuple", tuple(item() for _ in range(next(ints)))))
    return tuple(fields)


def describe(layout: Layout) -> str:
    def item(i: Item) -> str:
        return "None" if i is None else f"{str(i[0]).replace('torch.', '')}{list(i[1])}"

    parts = []
    for field in layout:
        if field is None:
            parts.append("None")
        elif field[0] == "tensor":
            parts.append(item(field[1]))
        else:
            parts.append("(" + ", ".join(item(i) for i in field[1]) + ")")
    return "(" + ", ".join(parts) + ")"


# --- stage 0's micro-batches: read from the user's iterator, their layout fixed by the first ---


def to_device(value: Any, device: Any) -> Any:
    """Tensors (inside tuples and lists) moved to ``device``; anything else as it is. From host memory to a GPU
    the copy goes through pinned memory without blocking: a copy from pageable memory would wait for the
    device's queued work, a host sync at every micro-batch stage 0 reads."""
    to_cuda = torch.device(device).type == "cuda"

    def move(t: Tensor) -> Tensor:
        if to_cuda and t.device.type == "cpu":
            return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
        return t.to(device)

    return map_tensors(move, value, sequence=tuple)


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


def check_layout(first: Layout | None, batch: tuple[Any, Any], micro_batch: int) -> Layout:
    """The layout of training's micro-batches, fixed by the first one: PETRA exchanges shapes once."""
    layout = layout_of(batch)
    if first is not None and layout != first:
        raise MessageLayoutError(
            f"micro-batch {micro_batch} has layout {describe(layout)} but the first one had "
            f"{describe(first)}; PETRA exchanges shapes once: keep the micro-batch size fixed "
            "(e.g. DataLoader(drop_last=True))")
    return first or layout

"""The one walk over nested tensors: messages, holdings, optimizer states and checks all hold tensors inside
tuples, lists, deques and dicts; micro-batches and layer inputs are rebuilt with each tensor mapped."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator

from torch import Tensor


def tensors_in(obj: Any) -> Iterator[Tensor]:
    """Every tensor inside nested tuples, lists, deques and dict values, in order; anything else (None,
    numbers) holds none."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (tuple, list, deque)):
        for value in obj:
            yield from tensors_in(value)


def map_tensors(fn: Callable[[Tensor], Any], obj: Any, sequence: type | None = None) -> Any:
    """``obj`` with every tensor inside nested tuples, lists and dictionaries (values) replaced by ``fn(tensor)``;
    anything else as it is. Each tuple or list is rebuilt as its own type, or as ``sequence`` when given; each
    dictionary as its own type."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return (sequence or type(obj))(map_tensors(fn, value, sequence) for value in obj)
    if isinstance(obj, dict):
        return type(obj)((key, map_tensors(fn, value, sequence)) for key, value in obj.items())
    return obj

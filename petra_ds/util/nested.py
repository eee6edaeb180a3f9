"""The one walk over nested tensors: messages, holdings, optimizer states and checks all hold tensors inside
tuples, lists, deques and dicts; micro-batches and layer inputs are rebuilt with each tensor mapped."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable

from torch import Tensor


def tensors_in(obj: Any) -> list[Tensor]:
    """Every tensor inside nested tuples, lists, deques and dict values, in order; anything else (None,
    numbers) holds none. A list, gathered without a generator per level: messages are walked at every send."""
    found: list[Tensor] = []
    _gather((obj,), found)
    return found


def _gather(values: Iterable[Any], found: list[Tensor]) -> None:
    for value in values:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, dict):
            _gather(value.values(), found)
        elif isinstance(value, (tuple, list, deque)):
            _gather(value, found)


def map_tensors(fn: Callable[[Tensor], Any], obj: Any, sequence: type | None = None) -> Any:
    """``obj`` with every tensor inside nested tuples, lists and dictionaries (values) replaced by ``fn(tensor)``;
    anything else as it is. Each tuple or list is rebuilt as its own type, or as ``sequence`` when given; each
    dictionary as its own type."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return (sequence or type(obj))([fn(value) if isinstance(value, Tensor) else map_tensors(fn, value, sequence)
                                        for value in obj])
    if isinstance(obj, dict):
        return type(obj)((key, map_tensors(fn, value, sequence)) for key, value in obj.items())
    return obj

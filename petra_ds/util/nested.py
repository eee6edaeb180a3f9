"""The one walk over nested tensors: messages, holdings, optimizer states and checks all hold tensors inside
tuples, lists, deques and dicts."""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

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

"""Autograd's grad mode switched for a block at the host cost of two C calls.

``torch.no_grad()`` and ``torch.enable_grad()`` build their context in Python layers: a ``__new__`` that lets them
decorate, an ``__init__`` that asks whether TorchScript is scripting, and an ``__enter__`` and ``__exit__`` that each
build a ``torch.set_grad_enabled``: 89 bytecodes a use on Python 3.11, against these 26. A PETRA clock switches the
mode around every branch's reconstruction, every subtraction that inverts a coupling and every stage's evaluation:
dozens of times a clock when one process hosts every stage. These do the same switch, autograd's own, with the mode
found put back on exit. For the hot paths only; elsewhere torch's read better."""

from __future__ import annotations

import functools

from torch import is_grad_enabled as _is_grad_enabled
from torch._C import _set_grad_enabled  # what torch.set_grad_enabled ends in; no public name calls it directly


class GradMode:
    """Within it, autograd records (``mode`` true) or not; on exit, the mode it found. One use per instance."""

    __slots__ = ("_mode", "_previous")

    def __init__(self, mode: bool) -> None:
        self._mode = mode

    def __enter__(self) -> None:
        self._previous = _is_grad_enabled()
        _set_grad_enabled(self._mode)

    def __exit__(self, *exc: object) -> None:
        _set_grad_enabled(self._previous)


#: ``with no_grad():`` and ``with enable_grad():`` as torch's, made without a Python frame
no_grad = functools.partial(GradMode, False)
enable_grad = functools.partial(GradMode, True)

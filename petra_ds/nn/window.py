"""What holds still for the length of a training window.

Inside the engine's ``train_batch`` window no module gains, loses or freezes a parameter, changes its submodules,
its hooks, a dropout's rate or its training mode: no user code but the loss and the observers runs, and they are
not the place for it. What depends only on those is worked out once per window, by whoever needs it
(``accumulate.py``: which parameters a graph accumulates into; ``draws.py``: which branches draw random numbers), in
a cache that lives as long as the window. Outside a window there is no cache and each asks afresh.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator


class _Window(threading.local):
    #: purpose -> its cache, inside :func:`modules_fixed` (None outside)
    caches: dict[str, dict[Any, Any]] | None = None


_window = _Window()


@contextmanager
def modules_fixed() -> Iterator[None]:
    """Within it, no module changes (see the module's docstring): per-window caches live until it ends."""
    previous, _window.caches = _window.caches, {}
    try:
        yield
    finally:
        _window.caches = previous


def window_cache(purpose: str) -> dict[Any, Any] | None:
    """The current window's cache for ``purpose`` (None outside a window)."""
    caches = _window.caches
    if caches is None:
        return None
    found = caches.get(purpose)
    if found is None:
        found = caches[purpose] = {}
    return found

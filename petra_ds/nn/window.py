"""What holds still for the length of a training window.

Inside the engine's ``train_batch`` window no module gains, loses or freezes a parameter, changes its submodules,
its hooks, a dropout's rate or its training mode: no user code but the loss and the observers runs, and they are
not the place for it. What depends only on those is worked out once per window, by whoever needs it
(``accumulate.py``: which parameters a graph accumulates into; ``draws.py``: which branches draw random numbers), in
a cache that lives as long as the window. Outside a window there is no cache and each asks afresh.

The engine's windows also share a :class:`Lasting`: what was worked out about a module is kept from one window to the
next while the engine's module trees stay as they were, checked at each window's start in passes that run in C (the
walks that this saves were 7% of PETRA's Python bytecodes per ``train_batch`` on negligible RevGPT).
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, TypeVar

from torch.nn.modules import module as torch_module

_MODULES, _PARAMETERS, _TRAINING = (operator.attrgetter(name) for name in ("_modules", "_parameters", "training"))
_HOOKS, _PRE_HOOKS = operator.attrgetter("_forward_hooks"), operator.attrgetter("_forward_pre_hooks")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_IS_NOT_NONE = functools.partial(operator.is_not, None)  # a parameter or submodule slot may hold None
T = TypeVar("T")


class Lasting:
    """Facts about the modules under ``roots`` kept across the windows of one engine, for as long as every one of
    those modules keeps its type, submodules, parameters (each trainable or frozen as it was), forward hooks and
    training mode, and no global forward hook comes or goes: what a window holds still, held still between windows
    too. Anything else a fact depends on (a dropout's rate, a module's own ``draws_random``) its owner asks anew in
    each window."""

    def __init__(self, roots: Iterable[Any]) -> None:
        self._roots = list(roots)
        self._modules: list[Any] = []
        self._readings: tuple | None = None
        self._held: list[Any] = []  # the parameters read: held, so that no new one takes an old one's id
        #: the ids of the modules under the roots: facts are kept for these
        self.covered: frozenset[int] = frozenset()
        #: purpose -> module id -> (module, fact)
        self.facts: collections.defaultdict[str, dict[int, Any]] = collections.defaultdict(dict)

    def start_window(self) -> None:
        """At a window's start: the facts kept stand if nothing they depend on changed since the last window."""
        if self._readings is not None and _readings(self._modules)[0] == self._readings:
            return
        found, pending = {}, list(self._roots)
        while pending:  # ``modules()`` would hash them, and a module need not be hashable
            module = pending.pop()
            if id(module) not in found:
                found[id(module)] = module
                pending.extend(filter(_IS_NOT_NONE, module._modules.values()))
        self._modules = list(found.values())
        self._readings, self._held = _readings(self._modules)
        self.covered = frozenset(found)
        self.facts.clear()


def _readings(modules: list[Any]) -> tuple[tuple, list[Any]]:
    """What :class:`Lasting` compares from one window to the next, read in C-level passes, and the parameters read."""
    parameters = list(itertools.chain.from_iterable(map(dict.values, map(_PARAMETERS, modules))))
    return (list(map(type, modules)),
            list(map(tuple, map(map, itertools.repeat(id), map(dict.values, map(_MODULES, modules))))),
            list(map(id, parameters)), list(map(_REQUIRES_GRAD, filter(_IS_NOT_NONE, parameters))),
            list(map(bool, map(_HOOKS, modules))), list(map(bool, map(_PRE_HOOKS, modules))),
            list(map(_TRAINING, modules)), bool(torch_module._global_forward_hooks),
            bool(torch_module._global_forward_pre_hooks)), parameters


class _Window(threading.local):
    #: purpose -> its cache, inside :func:`modules_fixed` (None outside)
    caches: dict[str, dict[Any, Any]] | None = None
    lasting: Lasting | None = None


_window = _Window()


@contextmanager
def modules_fixed(lasting: Lasting | None = None) -> Iterator[None]:
    """Within it, no module changes (see the module's docstring): per-window caches live until it ends;
    ``lasting``: what the windows of one engine keep between them."""
    if lasting is not None:
        lasting.start_window()
    previous = _window.caches, _window.lasting
    _window.caches, _window.lasting = {}, lasting
    try:
        yield
    finally:
        _window.caches, _window.lasting = previous


def window_cache(purpose: str) -> dict[Any, Any] | None:
    """The current window's cache for ``purpose`` (None outside a window)."""
    caches = _window.caches
    if caches is None:
        return None
    found = caches.get(purpose)
    if found is None:
        found = caches[purpose] = {}
    return found


def _lasting_cache(purpose: str, module: Any) -> dict[int, Any] | None:
    """The cache for ``purpose`` that the current window shares with the engine's other windows (module id ->
    (module, fact)), if ``module`` is one of the engine's (:class:`Lasting`); else None."""
    lasting = _window.lasting
    return None if lasting is None or id(module) not in lasting.covered else lasting.facts[purpose]


def kept(purpose: str, module: Any, make: Callable[..., T], *args: Any) -> T:
    """``make(module, *args)``, a fact about ``module`` for ``purpose``: kept between the engine's windows where it
    lasts (:class:`Lasting`), else for the window, else made at each call (outside a window); kept as :func:`held`
    keeps it."""
    cache = _lasting_cache(purpose, module)
    return held(window_cache(purpose) if cache is None else cache, module, make, *args)


def held(cache: dict[Any, Any] | None, module: Any, make: Callable[..., T], *args: Any) -> T:
    """``make(module, *args)``, kept in ``cache`` (None: made at each call) with the module, under its id: a module
    need not be hashable, and held, its id stays its own."""
    found = None if cache is None else cache.get(id(module))
    if found is not None and found[0] is module:
        return found[1]
    fact = make(module, *args)
    if cache is not None:
        cache[id(module)] = (module, fact)
    return fact

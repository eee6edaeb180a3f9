"""What an engine's windows keep between them (``petra_ds.nn.window.Lasting``): which modules can draw and which
parameters a graph accumulates into, worked out in one window and kept while the modules stay as they were. Each
change a window holds still, made between two windows, is seen at the next one's start and answered as a fresh walk
answers; a dropout's rate and a module's own ``draws_random`` are asked in every window."""

import pytest
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from benchmarks.lib import host_overhead
from petra_ds.nn.accumulate import backprop
from petra_ds.nn.draws import draws_random, may_draw
from petra_ds.nn.window import Lasting, modules_fixed
from test_draws import Declared, Noisy, SubclassedLinear, walks_counted

TINY = host_overhead.parse_args(["--tiny"])


def tree() -> nn.Sequential:
    """Draws nothing: a dropout at rate 0, one in eval mode, a module that declares it draws nothing."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.0), nn.Linear(8, 4)),
                         nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3).eval()), Declared(False))


def _set_class(module: nn.Module, kind: type) -> None:
    module.__class__ = kind


#: a change between windows, made by a function of the tree (a hook's registration returns its handle)
CHANGES = {
    "a parameter replaced": lambda t: setattr(t[0][0], "weight", nn.Parameter(torch.zeros(8, 4))),
    "a parameter frozen": lambda t: t[0][3].bias.requires_grad_(False),
    "a submodule replaced": lambda t: t[0].__setitem__(1, Noisy()),
    "a submodule added": lambda t: t[1].append(nn.Linear(4, 4)),
    "a submodule removed": lambda t: (setattr(t[2], "draws", True), t.__delitem__(2)),  # would draw, if still there
    "a forward hook": lambda t: t[0][1].register_forward_hook(lambda *args: None),
    "a forward pre-hook": lambda t: t[1][0].register_forward_pre_hook(lambda *args: None),
    "a global forward hook": lambda t: nn.modules.module.register_module_forward_hook(lambda *args: None),
    "a training mode": lambda t: t[1][1].train(),
    "a module's type": lambda t: _set_class(t[0][3], SubclassedLinear),
    "a dropout's rate": lambda t: setattr(t[0][2], "p", 0.5),
    "a module's own answer": lambda t: setattr(t[2], "draws", True),
}


def facts(root: nn.Sequential) -> tuple[list[bool], list[torch.Tensor | None]]:
    """Whether each module can draw, and each parameter's gradient from ``backprop`` of one micro-batch (every
    ``.grad`` zero before, so that it adds into the parameters it found trainable)."""
    parameters = [p for _, p in root.named_parameters()]  # not counted as collected: backprop's are
    for p in parameters:
        p.grad = torch.zeros_like(p)
    torch.manual_seed(1)
    x = torch.randn(2, 4, requires_grad=True)
    backprop([root(x)], [torch.ones(2, 4)], [x], root)
    return list(map(draws_random, root.modules())), [p.grad for p in parameters]


def same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(map(torch.equal, a[1], b[1]))


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_between_windows_is_answered_as_a_fresh_walk_answers(change):
    root = tree()
    lasting = Lasting([root])
    for _ in range(2):
        with modules_fixed(lasting):
            before = facts(root)
    handle = CHANGES[change](root)
    try:
        with modules_fixed(lasting):
            after = facts(root)
        fresh = facts(root)  # outside a window: walked afresh
    finally:
        if isinstance(handle, RemovableHandle):  # a hook's
            handle.remove()
    assert same(after, fresh)
    assert not same(after, before)  # each change changes an answer: one missed would fail the line above


def test_a_steady_window_walks_nothing_and_a_module_outside_the_roots_is_walked_each_window(monkeypatch):
    walked, collected = _counted(monkeypatch)
    root = tree()
    lasting = Lasting([root])
    with modules_fixed(lasting):
        first = facts(root)
    assert walked and collected
    walked.clear()
    collected.clear()
    with modules_fixed(lasting):
        assert same(facts(root), first)
    assert walked == [] and collected == []
    other = nn.Linear(2, 2)
    for _ in range(2):
        with modules_fixed(lasting):
            assert not may_draw(other)
    assert walked == [other, other]


def test_the_engine_s_steady_windows_walk_no_module(world_of_one, monkeypatch):
    """RevGPT in one process: after its first window the engine walks no module for ``draws`` and collects no
    owner's parameters for ``accumulate`` (a dropout switched on between windows: ``test_draws.py``)."""
    m, k = host_overhead.model("revgpt", TINY), TINY.k
    engine, stream = host_overhead.petra_engine(m, k), host_overhead.data(m)
    engine.train_batch(stream)
    walked, collected = _counted(monkeypatch)
    engine.train_batch(stream)
    assert walked == [] and collected == []


def _counted(monkeypatch) -> tuple[list, list]:
    """The modules ``draws`` walks and those whose parameters are collected, from now on."""
    walked, collected = walks_counted(monkeypatch), []
    parameters = nn.Module.parameters
    monkeypatch.setattr(nn.Module, "parameters", lambda self, *args, **kwargs: collected.append(self)
                        or parameters(self, *args, **kwargs))
    return walked, collected

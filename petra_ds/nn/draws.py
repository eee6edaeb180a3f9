"""Which modules can draw random numbers, so that a keyed scope with nothing to key is skipped.

A reversible branch runs under its own keyed stream (``rng.layer_rng``) so that its reconstruction draws what its
forward drew, and a stage runs each instruction under its micro-batch's (``rng.micro_batch_rng``). Seeding the
generators and putting them back costs the host microseconds per scope, at every branch, micro-batch and clock,
and on a CPU their states (2.5 KB for the Mersenne twister) go through the caches each time: with dropout off
(RevNets, most LLM pre-training) that was 5-8% of a clock's host time for nothing. Where nothing under a branch (a
stage) can draw, its scope is skipped: it draws what it drew before, nothing.

"Can draw" is decided conservatively, once per training window, or in an engine once for as long as its modules stay
as they were (``window.py``; outside a window every scope is keyed, as it always was): a walk finds what the answer
depends on (``_Plan``), and a dropout's rate and a module's own declaration are read in each window. A module draws
nothing when no forward hook can run on it and it is

- of a torch.nn type known to draw nothing (the layers, norms, activations, pools and containers below; an exact
  type, not a subclass, whose forward may do anything), each module under it too;
- a dropout that is off: ``p == 0`` or in evaluation;
- or it declares so: a ``draws_random()`` method answers for the module and everything under it (this project's
  couplings and models do), honoured while the class that declares it also defines the ``forward`` that runs.

A function draws nothing when it is one of torch's losses, or says so (a ``draws_random`` attribute, as
``models.transformer.lm_loss`` has). Anything else may draw, and keeps its keyed scope.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any, NamedTuple

from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as torch_module

from .window import held, kept, window_cache

#: torch.nn types whose forward draws no random number (an exact type; RReLU and the fractional pools draw)
_DETERMINISTIC = frozenset({
    nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh,
    nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.LogSigmoid, nn.GLU,
    nn.Softmax, nn.LogSoftmax,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle,
    nn.CrossEntropyLoss, nn.NLLLoss, nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss,
    nn.BCEWithLogitsLoss, nn.KLDivLoss,
})
#: torch's loss functions (a stage's ``loss_fn`` is often one): they draw nothing
_DETERMINISTIC_FUNCTIONS = frozenset({
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits, F.kl_div,
})
#: torch.nn's dropouts: they draw in training when ``p > 0``
_DROPOUTS = frozenset({nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout})


def draws_random(module: Any) -> bool:
    """Whether running ``module`` can draw random numbers (see the module's docstring). Outside a training window it
    is asked afresh each time; inside one, each module's answer is worked out once, when the window first asks for
    it, and stands for the window. A tuple of parts run together draws when any of them does."""
    return _draws(module, window_cache("draws"))


def by_children(module: nn.Module) -> bool:
    """A ``draws_random`` for a module whose own forward draws nothing: its submodules decide (``draws_random =
    by_children`` in its class)."""
    return kept("draw plans of children", module, _children_plan).draws()


def may_draw(module: Any) -> bool:
    """:func:`draws_random`, worked out once per training window; outside a window, True: keyed, as always."""
    cache = window_cache("draws")
    if cache is None:
        return True
    return _draws(module, cache)


def _draws(module: Any, cache: dict | None) -> bool:
    """:func:`draws_random` with the window's answers (None: outside a window). The cache holds a module's answer
    as ``window.held`` keeps it and a tuple's answer under the tuple."""
    if isinstance(module, nn.Module):
        return held(cache, module, _module_draws)
    if isinstance(module, tuple):
        found = None if cache is None else cache.get(module)
        if found is None:
            found = any(map(_draws, module, itertools.repeat(cache)))
            if cache is not None:
                cache[module] = found
        return found
    if module in _DETERMINISTIC_FUNCTIONS:  # a function: torch's losses draw nothing, others may say so
        return False
    declared = getattr(module, "draws_random", None)
    return True if declared is None else bool(declared())


#: a submodule slot that holds a module (``register_module(name, None)`` leaves None in it)
_IS_MODULE = functools.partial(operator.is_not, None)
_RATE = operator.attrgetter("p")
_POSITIVE = functools.partial(operator.lt, 0)
_ASK = operator.methodcaller("draws_random")


class _Plan(NamedTuple):
    """What a module's answer is made of, found by walking it once: whether it draws in any case (``always``: a hook,
    a type not known to draw nothing), the dropouts in training mode under it (each draws while its rate is above 0)
    and the modules under it that answer for themselves (asked in each window). The walk reads only what a window
    holds still (``window.py``), so a plan lasts as long as the engine's :class:`~.window.Lasting` keeps it."""

    always: bool
    dropouts: tuple
    asked: tuple

    def draws(self) -> bool:
        return self.always or any(map(_POSITIVE, map(_RATE, self.dropouts))) or any(map(_ASK, self.asked))


_NEVER = _Plan(False, (), ())
_ALWAYS = _Plan(True, (), ())


def _module_draws(module: nn.Module) -> bool:
    return _plan(module).draws()


def _plan(module: nn.Module) -> _Plan:
    return kept("draw plans", module, _walk)


def _walk(module: nn.Module) -> _Plan:
    if hooked(module):
        return _ALWAYS
    kind = type(module)
    declared = _declaration(kind)
    if declared and kind.draws_random is not by_children:
        return _Plan(False, (), (module,))
    if kind in _DROPOUTS:
        return _Plan(False, (module,) if module.training else (), ())
    if kind not in _DETERMINISTIC and not declared:
        return _ALWAYS
    return _children_plan(module)


def _children_plan(module: nn.Module) -> _Plan:
    parts = list(map(_plan, filter(_IS_MODULE, module._modules.values())))
    if not parts:
        return _NEVER
    if any(part.always for part in parts):
        return _ALWAYS
    return _Plan(False, sum((part.dropouts for part in parts), ()), sum((part.asked for part in parts), ()))


def hooked(module: nn.Module) -> bool:
    """Whether a forward hook or pre-hook, the module's own or a global one, can run user code in its forward."""
    return bool(module._forward_hooks or module._forward_pre_hooks or torch_module._global_forward_hooks
                or torch_module._global_forward_pre_hooks)


def hooked_under(module: nn.Module) -> bool:
    """Whether a forward hook can run user code in ``module``'s forward or in one of its submodules'."""
    return any(map(hooked, module.modules()))


def _declaration(kind: type) -> bool:
    """Whether ``kind`` inherits a ``draws_random()`` from a class that also defines the ``forward`` it runs."""
    for klass in kind.__mro__:
        if "draws_random" in vars(klass):
            return kind.forward is klass.forward
        if "forward" in vars(klass):
            return False
    return False

"""Parameter gradients added into ``.grad`` by one multi-tensor op per graph, not one op per parameter.

``Tensor.backward`` adds each parameter's gradient into its ``.grad`` by that parameter's own ``add_``
(autograd's AccumulateGrad): a kernel per parameter, per graph, per micro-batch on a GPU. A PETRA stage
differentiates every block on its own graph k times per step, so those adds were a tenth of its kernels.
:func:`backprop` takes the gradients as ``torch.autograd.grad`` returns them instead and adds them with one
``torch._foreach_add_``: the same additions of the same values, so the same bits. The step's first
micro-batch, where a ``.grad`` is still None, goes through autograd's own accumulation, which adopts the
fresh gradients without a copy and knows when one is shared and must be copied.

Which parameters a graph accumulates into is its owner's (a coupling's F, a stage): checked against the first
graph after the owner's parameters last changed. An owner whose graph reaches a parameter it does not hold (a
closure over another module's weight) keeps autograd's accumulation, which finds every parameter. Inside the
engine's window (``window.modules_fixed``) an owner's parameters are collected and checked once, not at every
graph, and kept across the engine's windows while its modules stay as they were (``window.Lasting``).
"""

from __future__ import annotations

import functools
import operator
import weakref
from typing import Any, Sequence

import torch
from torch import Tensor

from .window import kept

#: a tensor's ``.grad`` and ``.requires_grad`` read at C level: per-tensor loops through ``map`` and ``filter``
#: run no Python frame per tensor (a stage runs them per graph and per backward)
GRAD, REQUIRES_GRAD = operator.attrgetter("grad"), operator.attrgetter("requires_grad")
_IS_NONE = functools.partial(operator.is_, None)

#: owner -> (the ids of the parameters it held when checked, whether its graph reaches no others)
_CHECKED: "weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], bool]]" = weakref.WeakKeyDictionary()

#: the engine call that ``torch.autograd.grad`` and ``backward`` make after checking their arguments (None on a torch
#: without it)
ENGINE_ENTRY = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _trainable(owner: Any, outputs: Sequence[Tensor], leaves: Sequence[Tensor]) -> tuple[list[Tensor], bool]:
    """``owner``'s trainable parameters, and whether its graphs accumulate into no others (checked on the first
    graph after its parameters last changed); kept for the window or longer (``window.kept``)."""
    params = tuple(owner.parameters())
    ids = tuple(map(id, params))
    checked = _CHECKED.get(owner)
    if checked is None or checked[0] != ids:
        checked = _CHECKED[owner] = (ids, _reaches_only(outputs, leaves, params))
    return [p for p in params if p.requires_grad], checked[1]


def backprop(outputs: Sequence[Tensor], grads: Sequence[Tensor | None], leaves: Sequence[Tensor],
             owner: Any) -> list[Tensor | None]:
    """Pull ``grads`` back through the graph of ``outputs`` (None for a scalar output means 1); return the
    gradient of each of ``leaves`` (None where it needs none or nothing flows to it) and add the parameter
    gradients into ``.grad`` as ``torch.autograd.backward`` does. ``owner`` has ``parameters()``: those the
    graph uses (None: unknown, autograd accumulates them)."""
    if owner is None:
        return _by_autograd(outputs, grads, leaves)
    trainable, reaches_only = kept("parameters", owner, _trainable, outputs, leaves)
    targets = list(map(GRAD, trainable))
    if not reaches_only or any(map(_IS_NONE, targets)):
        return _by_autograd(outputs, grads, leaves)
    wanted = list(filter(REQUIRES_GRAD, leaves))
    found = _engine(outputs, grads, wanted + trainable, accumulate=False)
    added = list(found[len(wanted):])
    if any(map(_IS_NONE, added)):  # a parameter this graph does not reach
        reached = [(a, g) for a, g in zip(targets, added) if g is not None]
        targets, added = [a for a, _ in reached], [g for _, g in reached]
    if targets:  # no graph is recorded: neither side requires grad (create_graph is off)
        torch._foreach_add_(targets, added)
    if len(wanted) == len(leaves):
        return list(found[:len(wanted)])
    leaf_grads = iter(found[:len(wanted)])
    return [next(leaf_grads) if t.requires_grad else None for t in leaves]


def _by_autograd(outputs: Sequence[Tensor], grads: Sequence[Tensor | None],
                 leaves: Sequence[Tensor]) -> list[Tensor | None]:
    """``torch.autograd.backward``: each parameter's gradient added by autograd, the leaves' read from ``.grad``."""
    _engine(outputs, grads, [], accumulate=True)
    return [t.grad if t.requires_grad else None for t in leaves]


def _engine(outputs: Sequence[Tensor], grads: Sequence[Tensor | None], inputs: Sequence[Tensor], *,
            accumulate: bool) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, allow_unused=True)`` (``accumulate``: ``torch.autograd.backward
    (outputs, grads)``) as the C++ engine call both end in, without their Python argument handling: on a small
    graph that handling took as long as the engine (about 40 of 100 us on a CPU), and a stage makes a call per
    coupling branch per micro-batch. The engine still checks each gradient's shape, dtype and device against its
    output. A torch without that entry point takes the public functions."""
    grads = tuple(torch.ones_like(out) if grad is None else grad for out, grad in zip(outputs, grads))
    if ENGINE_ENTRY is None:
        if accumulate:
            torch.autograd.backward(outputs, grads)
            return ()
        return torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    return ENGINE_ENTRY(tuple(outputs), grads, False, False, tuple(inputs), True, accumulate_grad=accumulate)


def _reaches_only(outputs: Sequence[Tensor], leaves: Sequence[Tensor], params: tuple[Tensor, ...]) -> bool:
    """Whether every tensor the graph of ``outputs`` accumulates into is one of ``params`` or ``leaves``."""
    known = {id(t) for t in (*params, *leaves)}
    seen, pending = set(), [t.grad_fn for t in outputs if t.grad_fn is not None]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the tensor it adds into
        if variable is not None and id(variable) not in known:
            return False
        pending.extend(n for n, _ in node.next_functions if n is not None)
    return True

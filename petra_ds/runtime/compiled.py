"""``"petra": {"compile": true}``: a stage's layers run through ``torch.compile``.

What a PETRA clock evaluates is small functions many times: a coupling's F and G in the forward (no graph)
and again in the reconstruction (with a graph, then its VJP), and a non-reversible layer in its forward and
recomputation. Compiling F, G and those layers in place (``nn.Module.compile``: the module keeps its
parameters, names and state dict, so checkpoints do not change) covers all three: the compiled forward runs
in the forward, and AOTAutograd's compiled forward and backward in the reconstruction and the VJP. The
couplings' own code (the residual additions and subtractions, keyed RNG scopes) stays eager: it is a few ops
per block, and it is what makes the reconstruction exact.

Random ops inside compiled code draw from torch's generators as eager ops do (inductor's
``fallback_random``), so the keyed scopes give the forward and the reconstruction the same masks.

CUDA graphs (:data:`CUDA_GRAPH_MODES`) replay into the same output buffers, so a graph's outputs last until its
next replay. F's and G's outputs are consumed inside their coupling, but a whole layer's outputs leave it (the
next layer's input, the stage's message, a FIFO entry): such a layer returns copies made outside the graph.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..nn.coupling import AdditiveCoupling, HalfCoupling, SwapCoupling
from ..nn.reversible import Reversible, ReversibleSequential
from ..util.nested import map_tensors

#: inductor's modes: "reduce-overhead" replays CUDA graphs (static shapes, as PETRA's messages are)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: the modes whose compiled code replays CUDA graphs on a GPU
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_layers(layers: Iterable[object], how: bool | str = True) -> None:
    """Compile, in place, the branches of every coupling among ``layers`` and every module that is not
    reversible; parameter-free reversible layers (splits, merges) stay eager. ``how``: the ``"petra"`` key's
    value, true (inductor), a backend's name, or one of inductor's :data:`MODES`."""
    torch._inductor.config.fallback_random = True
    options = {"mode": how} if how in MODES else {"backend": "inductor" if how is True else how}
    for layer in layers:
        parts = _compiled_parts(layer)
        if how in CUDA_GRAPH_MODES and parts == [layer]:
            compile_owning_outputs(layer, options)
            continue
        for module in parts:
            module.compile(**options)


def compile_owning_outputs(module: nn.Module, options: dict) -> None:
    """Compile ``module``'s forward in place and return copies of its outputs, made outside the compiled code
    (``nn.Module.compile`` would compile its hooks too), so that they outlive the graph's next replay."""
    module.forward = functools.partial(_copies_of, torch.compile(module.forward, **options))


def _copies_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return map_tensors(torch.clone, fn(*args, **kwargs))


def _compiled_parts(layer: object) -> list[nn.Module]:
    if isinstance(layer, ReversibleSequential):
        return [part for sub in layer.layers for part in _compiled_parts(sub)]
    if isinstance(layer, AdditiveCoupling):
        return [layer.F, layer.G]
    if isinstance(layer, (SwapCoupling, HalfCoupling)):
        return [layer.F]
    if isinstance(layer, Reversible) or not isinstance(layer, nn.Module):
        return []
    return [layer]

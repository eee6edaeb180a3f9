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

Inductor's CUDA-graph modes (:data:`CUDA_GRAPH_MODES`) are refused by the config: a replay writes into the
buffers of the graph's earlier results, and a stage keeps results across other replays, from its reconstruction
until its VJP reads them (an H100 run failed so, copies of whole layers' outputs notwithstanding).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..nn.coupling import AdditiveCoupling, HalfCoupling, SwapCoupling
from ..nn.reversible import Reversible, ReversibleSequential

#: inductor's modes that compile_layers takes
MODES = ("default", "max-autotune-no-cudagraphs")
#: inductor's modes whose compiled code replays CUDA graphs on a GPU (the config refuses them)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_layers(layers: Iterable[object], how: bool | str = True) -> None:
    """Compile, in place, the branches of every coupling among ``layers`` and every module that is not
    reversible; parameter-free reversible layers (splits, merges) stay eager. ``how``: the ``"petra"`` key's
    value, false (nothing to do), true (inductor), a backend's name, or one of inductor's :data:`MODES`."""
    if not how:
        return
    torch._inductor.config.fallback_random = True
    options = {"mode": how} if how in MODES else {"backend": "inductor" if how is True else how}
    for layer in layers:
        for module in compiled_parts(layer):
            module.compile(**options)


def compiled_parts(layer: object) -> list[nn.Module]:
    """The modules of ``layer`` that run its arithmetic: a coupling's F and G, or the layer itself when it is not
    reversible (what ``compile`` compiles and ``cuda_graphs`` graphs)."""
    if isinstance(layer, ReversibleSequential):
        return [part for sub in layer.layers for part in compiled_parts(sub)]
    if isinstance(layer, AdditiveCoupling):
        return [layer.F, layer.G]
    if isinstance(layer, (SwapCoupling, HalfCoupling)):
        return [layer.F]
    if isinstance(layer, Reversible) or not isinstance(layer, nn.Module):
        return []
    return [layer]

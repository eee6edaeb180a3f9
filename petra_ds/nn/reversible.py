"""The reversible-layer protocol and the chain of reversible layers.

A layer is reversible when it has ``inverse(y)`` with ``inverse(forward(x)) == x`` up to rounding.
Its ``reconstruct(y)`` returns the reconstructed input together with a :class:`Tape`: the graph that
``tape.backward(dy)`` differentiates to return ``dx`` and accumulate the parameter gradients. Layers
that can build that graph while inverting (the couplings) do so, which keeps every function to one
evaluation in the forward and one in the reconstruction.

Activations are a tensor or a tuple of tensors (the two streams of a coupling travel as a pair).

:func:`reconstruct_and_backward` runs a chain's reconstruction and backward block by block instead of
all reconstructions first (PaReprop, Zhu and Mangalam 2023): block i-1's reconstruction needs only
block i's reconstructed input, not its gradients, so on CUDA the two run on two streams at once.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Sequence, Union

import torch
from torch import Tensor, nn

from ..util.grad_mode import enable_grad, no_grad
from .accumulate import backprop
from .draws import by_children

Activation = Union[Tensor, tuple[Tensor, ...]]


def as_tuple(x: Activation) -> tuple[Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def shaped_like(template: Activation, parts: Sequence[Tensor]) -> Activation:
    """``parts`` shaped as ``template`` (a bare tensor or a tuple)."""
    return tuple(parts) if isinstance(template, (tuple, list)) else parts[0]


def detach_leaf(x: Activation) -> Activation:
    """Fresh autograd leaves holding the values of ``x`` (floating tensors require grad)."""
    return shaped_like(x, [t.detach().requires_grad_(t.is_floating_point()) for t in as_tuple(x)])


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, without the call where ``t`` already has it: a call that changes nothing still costs the
    host a few microseconds, and a coupling would make several per block and micro-batch."""
    return t if t.dtype == dtype else t.to(dtype)


def vjp_into(output: Tensor, grad_output: Tensor | None, leaf: Tensor, owner: Any) -> Tensor | None:
    """Backpropagate ``grad_output`` through ``output``'s graph; return ``leaf``'s gradient.

    Parameter gradients (``owner``'s, see :func:`~petra_ds.nn.accumulate.backprop`) accumulate into
    ``.grad`` as with ``loss.backward()``. The leaf gradient is ``None`` when nothing flows to it.
    """
    if grad_output is None or not output.requires_grad:
        return None
    return backprop([output], [as_dtype(grad_output, output.dtype)], [leaf], owner)[0]


def add_grad(a: Tensor, b: Tensor | None) -> Tensor:
    return a if b is None else a + as_dtype(b, a.dtype)


def _grad_or_zeros(leaf: Tensor, grad: Tensor | None) -> Tensor | None:
    if not leaf.requires_grad:  # an integer input, or data kept out of the graph
        return None
    return grad if grad is not None else torch.zeros_like(leaf)


class Tape:
    """The graph a reconstruction (or recomputation) built, waiting for the incoming gradient."""

    def backward(self, dy: Activation) -> Activation:
        """Run the vector-Jacobian products for ``dy``; return ``dx``; accumulate parameter grads."""
        raise NotImplementedError


class GraphTape(Tape):
    """A recomputed graph from leaves ``inputs`` to ``outputs`` (the generic path). ``owner`` (a module, or
    anything with ``parameters()``) holds the parameters it uses; without one, autograd accumulates them."""

    def __init__(self, inputs: Activation, outputs: Activation, owner: Any = None) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.owner = owner

    def backward(self, dy: Activation) -> Activation:
        outs, grads = [], []
        for out, grad in zip(as_tuple(self.outputs), as_tuple(dy)):
            if grad is not None and out.requires_grad:
                outs.append(out)
                grads.append(as_dtype(grad, out.dtype))
        inputs = as_tuple(self.inputs)
        found = backprop(outs, grads, inputs, self.owner) if outs else [None] * len(inputs)
        dx = [_grad_or_zeros(leaf, g) for leaf, g in zip(inputs, found)]
        shape = self.inputs
        self.inputs = self.outputs = self.owner = None
        return shaped_like(shape, dx)


class SequentialTape(Tape):
    """Tapes of a chain, ordered from the last layer to the first."""

    def __init__(self, tapes: list[Tape]) -> None:
        self.tapes = tapes

    def backward(self, dy: Activation) -> Activation:
        for tape in self.tapes:
            dy = tape.backward(dy)
        self.tapes = []
        return dy


def reconstruct_and_backward(
    layers: Sequence[nn.Module],
    y: Activation,
    dy: Activation,
    vjp_context: Callable[[], ContextManager] = nullcontext,
    side_stream: "torch.cuda.Stream | None" = None,
) -> tuple[Activation, Activation]:
    """(x, dx) of the chain ``layers`` from its output ``y`` and output gradient ``dy``, block by block
    from the last: block i's input is reconstructed (building its graph), then its VJPs run.

    The arithmetic is that of reconstructing every block and then running the chain's tape: the same
    functions on the same values, so the same bits (and the same keyed draws: a block's draws do not
    depend on when it runs). At most two blocks' graphs are alive at once (block i's and block
    i-1's, being built), instead of the whole chain's.

    With ``side_stream`` (CUDA) the blocks alternate between the current stream and ``side_stream``:
    block i-1's reconstruction is issued on the other stream before block i's VJPs, so the two overlap.
    A block's VJPs run on the stream its graph was built on (autograd runs a backward op on its forward
    op's stream), hence the alternation. ``vjp_context`` is entered around every VJP: the caller
    reconstructs under its autocast, and the plain order runs the VJPs outside it.
    """
    blocks = [b for layer in reversed(list(layers)) for b in _blocks(layer)]
    current = None if side_stream is None else torch.cuda.current_stream(side_stream.device)
    streams = (current, side_stream)
    if side_stream is not None:
        side_stream.wait_stream(current)  # the inputs, and the parameters the optimizer just wrote
    x, tape = reconstruct(blocks[0], y)
    rebuilt, differentiated = _event(current), None
    for n in range(len(blocks)):
        here, there = streams[n % 2], streams[(n + 1) % 2]
        if n + 1 < len(blocks):
            with _on(there):  # block n+1 (the one before in the chain) from block n's input
                _after(there, rebuilt, x)
                x_next, tape_next = reconstruct(blocks[n + 1], x)
                rebuilt = _event(there)
        with _on(here), vjp_context():
            _after(here, differentiated, dy)
            dy = tape.backward(dy)
            differentiated = _event(here)
        if n + 1 < len(blocks):
            x, tape = x_next, tape_next
    if side_stream is not None:
        current.wait_stream(side_stream)
        _after(current, None, x)
        _after(current, None, dy)
    return x, dy


def _blocks(layer: nn.Module) -> list[nn.Module]:
    """``layer`` as a list of blocks, last first: a nested chain is walked block by block."""
    if isinstance(layer, ReversibleSequential):
        return [b for sub in reversed(list(layer.layers)) for b in _blocks(sub)]
    return [layer]


def _on(stream: "torch.cuda.Stream | None") -> ContextManager:
    return nullcontext() if stream is None else torch.cuda.stream(stream)


def _event(stream: "torch.cuda.Stream | None") -> "torch.cuda.Event | None":
    """An event after the work issued so far on ``stream`` (None without streams)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _after(stream: "torch.cuda.Stream | None", event: "torch.cuda.Event | None", values: Activation | None) -> None:
    """``stream`` waits for ``event``; the caching allocator will not hand ``values`` (made on another
    stream) to new tensors until the work ``stream`` holds when they are freed is done."""
    if stream is None:
        return
    if event is not None:
        stream.wait_event(event)
    for t in as_tuple(values) if values is not None else ():
        if isinstance(t, Tensor) and t.is_cuda:
            t.record_stream(stream)


class Reversible(nn.Module):
    """Base class of reversible layers.

    Subclasses implement ``forward`` and ``inverse``. The default ``reconstruct`` inverts without a
    graph and then re-runs ``forward`` with one: right for parameter-free layers; layers with learned
    functions override it to build the graph during the inversion.
    """

    #: index of the layer inside its stage, part of the keyed-RNG key (see ``assign_rng_keys``)
    rng_key: int = 0

    def inverse(self, y: Activation) -> Activation:
        raise NotImplementedError(f"{type(self).__name__} declares itself reversible but has no inverse()")

    def reconstruct(self, y: Activation) -> tuple[Activation, Tape]:
        with no_grad():
            x = self.inverse(y)
        x_leaf = detach_leaf(x)
        with enable_grad():
            y_again = self.forward(x_leaf)
        owner = self if isinstance(self, nn.Module) else None
        return shaped_like(x, [t.detach() for t in as_tuple(x)]), GraphTape(x_leaf, y_again, owner)


def is_reversible(module: nn.Module) -> bool:
    """Whether ``module`` declares an inverse (a :class:`Reversible`, or any module with ``inverse``)."""
    if isinstance(module, Reversible):
        return True
    return callable(getattr(module, "inverse", None))


def reconstruct(layer: nn.Module, y: Activation) -> tuple[Activation, Tape]:
    """``layer.reconstruct(y)``, or the generic invert-then-recompute for duck-typed layers."""
    if isinstance(layer, Reversible):
        return layer.reconstruct(y)
    return Reversible.reconstruct(layer, y)  # type: ignore[arg-type]


def assign_rng_keys(module: nn.Module, start: int = 0) -> int:
    """Number the reversible layers under ``module`` in definition order; return the next number."""
    key = start
    for sub in module.modules():
        if isinstance(sub, Reversible) and not isinstance(sub, ReversibleSequential):
            sub.rng_key = key
            key += 1
    return key


class ReversibleSequential(Reversible):
    """A chain of reversible layers, itself reversible."""

    draws_random = by_children  # its layers decide (``draws.py``)

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            if not is_reversible(layer):
                raise TypeError(
                    f"ReversibleSequential: layer {i} ({type(layer).__name__}) has no inverse(); "
                    "wrap it in a coupling (AdditiveCoupling / SwapCoupling) or keep it outside the chain"
                )
        self.layers = nn.ModuleList(layers)
        assign_rng_keys(self)

    def forward(self, x: Activation) -> Activation:
        for layer in self.layers:
            x = layer(x)
        return x

    def inverse(self, y: Activation) -> Activation:
        for layer in reversed(self.layers):
            y = layer.inverse(y)
        return y

    def reconstruct(self, y: Activation) -> tuple[Activation, Tape]:
        tapes = []
        for layer in reversed(self.layers):
            y, tape = reconstruct(layer, y)
            tapes.append(tape)
        return y, SequentialTape(tapes)


class Split(Reversible):
    """One tensor into two streams along ``dim`` (the RevNet channel split)."""

    draws_random = by_children

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x1, x2 = torch.chunk(x, 2, dim=self.dim)
        return x1, x2

    def inverse(self, y: tuple[Tensor, Tensor]) -> Tensor:
        return torch.cat(y, dim=self.dim)


class Merge(Reversible):
    """Two streams back into one tensor along ``dim``."""

    draws_random = by_children

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        return torch.cat(x, dim=self.dim)

    def inverse(self, y: Tensor) -> tuple[Tensor, Tensor]:
        y1, y2 = torch.chunk(y, 2, dim=self.dim)
        return y1, y2

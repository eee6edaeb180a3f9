"""The two reversible couplings, in one place.

additive (Gomez et al. 2017; Reformer; Rev-ViT)   y1 = x1 + F(x2)    y2 = x2 + G(y1)
swap (the paper's RevNet block, one branch)       y1 = x2            y2 = x1 + F(x2)
half (one residual update of the additive one)    y1 = x1 + F(x2)    y2 = x2         (or the mirror)

``reconstruct`` inverts and builds the gradient graph in the same evaluation of F and G: the F and
G evaluated while inverting are the ones differentiated (docs/design/clock.md), so each function runs
twice per micro-batch in total (forward, reconstruction), never three times.

An additive coupling is its F half followed by its G half: as two layers, a partition may cut between
F and G (a finer grain for balancing stages).

The streams keep their own dtype: under bf16 autocast F and G compute in bf16 while the residual
additions and subtractions stay in the streams' fp32, so reconstruction error does not grow with
depth faster than in fp32.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

from ..util.grad_mode import enable_grad, no_grad
from .reversible import Activation, Reversible, Tape, add_grad, as_dtype, vjp_into
from .draws import by_children
from .rng import layer_rng

F_BRANCH, G_BRANCH = 0, 1


def _leaf(t: Tensor) -> Tensor:
    return t.detach().requires_grad_()


def _plain(t: Tensor) -> Tensor:
    """``t`` outside any graph: itself when it is already (a received or reconstructed stream), without the
    detached view (one more op) that ``detach`` would make."""
    return t.detach() if t.requires_grad else t


def _undo(y: Tensor, residual: Tensor) -> Tensor:
    """``y - residual`` in ``y``'s dtype, outside any graph (no detached views needed)."""
    with no_grad():
        return y - as_dtype(residual, y.dtype)


class AdditiveCoupling(Reversible):
    """``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)``."""

    draws_random = by_children  # its own arithmetic draws nothing: F and G decide (``draws.py``)

    def __init__(self, F: nn.Module, G: nn.Module) -> None:
        super().__init__()
        self.F = F
        self.G = G

    def _f(self, x2: Tensor, **inputs: Any) -> Tensor:
        with layer_rng(self.rng_key, F_BRANCH, self.F):
            return self.F(x2, **inputs)

    def _g(self, y1: Tensor) -> Tensor:
        with layer_rng(self.rng_key, G_BRANCH, self.G):
            return self.G(y1)

    def forward(self, x: Activation, **f_inputs: Any) -> tuple[Tensor, Tensor]:
        """``f_inputs`` go to F only: at generation, an attention's key/value cache and the first position."""
        x1, x2 = x
        y1 = x1 + as_dtype(self._f(x2, **f_inputs), x1.dtype)
        y2 = x2 + as_dtype(self._g(y1), x2.dtype)
        return y1, y2

    def inverse(self, y: Activation) -> tuple[Tensor, Tensor]:
        y1, y2 = y
        x2 = y2 - as_dtype(self._g(y1), y2.dtype)
        x1 = y1 - as_dtype(self._f(x2), y1.dtype)
        return x1, x2

    def reconstruct(self, y: Activation) -> tuple[tuple[Tensor, Tensor], Tape]:
        y1, y2 = y
        with enable_grad():
            y1_leaf = _leaf(y1)
            g = self._g(y1_leaf)
        x2_leaf = _undo(y2, g).requires_grad_()
        with enable_grad():
            f = self._f(x2_leaf)
        return (_undo(y1, f), x2_leaf.detach()), _AdditiveTape(y1_leaf, g, x2_leaf, f, self.F, self.G)


class _AdditiveTape(Tape):
    """dy1_total = dy1 + G'(y1)^T dy2;  dx1 = dy1_total;  dx2 = dy2 + F'(x2)^T dy1_total."""

    def __init__(self, y1: Tensor, g: Tensor, x2: Tensor, f: Tensor, F: nn.Module, G: nn.Module) -> None:
        self.y1, self.g, self.x2, self.f, self.F, self.G = y1, g, x2, f, F, G

    def backward(self, dy: Activation) -> tuple[Tensor, Tensor]:
        dy1, dy2 = dy
        dy1_total = add_grad(dy1, vjp_into(self.g, dy2, self.y1, self.G))
        dx2 = add_grad(dy2, vjp_into(self.f, dy1_total, self.x2, self.F))
        self.y1 = self.g = self.x2 = self.f = self.F = self.G = None
        return dy1_total, dx2


class SwapCoupling(Reversible):
    """``y1 = x2``, ``y2 = x1 + F(x2)``: the paper's reversible residual block (Fig. 2)."""

    draws_random = by_children

    def __init__(self, F: nn.Module) -> None:
        super().__init__()
        self.F = F

    def _f(self, x2: Tensor) -> Tensor:
        with layer_rng(self.rng_key, F_BRANCH, self.F):
            return self.F(x2)

    def forward(self, x: Activation) -> tuple[Tensor, Tensor]:
        x1, x2 = x
        return x2, x1 + as_dtype(self._f(x2), x1.dtype)

    def inverse(self, y: Activation) -> tuple[Tensor, Tensor]:
        y1, y2 = y
        return y2 - as_dtype(self._f(y1), y2.dtype), y1

    def reconstruct(self, y: Activation) -> tuple[tuple[Tensor, Tensor], Tape]:
        y1, y2 = y
        with enable_grad():
            x2_leaf = _leaf(y1)
            f = self._f(x2_leaf)
        return (_undo(y2, f), _plain(y1)), _SwapTape(x2_leaf, f, self.F)


class _SwapTape(Tape):
    """dx1 = dy2;  dx2 = dy1 + F'(x2)^T dy2."""

    def __init__(self, x2: Tensor, f: Tensor, F: nn.Module) -> None:
        self.x2, self.f, self.F = x2, f, F

    def backward(self, dy: Activation) -> tuple[Tensor, Tensor]:
        dy1, dy2 = dy
        dx2 = add_grad(dy1, vjp_into(self.f, dy2, self.x2, self.F))
        self.x2 = self.f = self.F = None
        return dy2, dx2


class HalfCoupling(Reversible):
    """One residual update, the other stream passed through: ``y1 = x1 + F(x2), y2 = x2`` (``updates=1``)
    or ``y1 = x1, y2 = x2 + F(x1)`` (``updates=2``).

    ``HalfCoupling(F, 1)`` then ``HalfCoupling(G, 2)`` compute ``AdditiveCoupling(F, G)``. Each half draws
    its dropout from its own layer's key, so with dropout the two grains are equally valid samples, not
    the same one.
    """

    draws_random = by_children

    def __init__(self, F: nn.Module, updates: int) -> None:
        super().__init__()
        if updates not in (1, 2):
            raise ValueError(f"a half coupling updates stream 1 or 2, got {updates!r}")
        self.F = F
        self.updates = updates
        self._a, self._b = (0, 1) if updates == 1 else (1, 0)  # the stream updated, the stream read

    def _f(self, xb: Tensor, **inputs: Any) -> Tensor:
        with layer_rng(self.rng_key, F_BRANCH if self.updates == 1 else G_BRANCH, self.F):
            return self.F(xb, **inputs)

    def _pair(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        return (a, b) if self.updates == 1 else (b, a)

    def forward(self, x: Activation, **f_inputs: Any) -> tuple[Tensor, Tensor]:
        """``f_inputs`` go to F: at generation, an attention's key/value cache and the first position."""
        xa, xb = x[self._a], x[self._b]
        return self._pair(xa + as_dtype(self._f(xb, **f_inputs), xa.dtype), xb)

    def inverse(self, y: Activation) -> tuple[Tensor, Tensor]:
        ya, yb = y[self._a], y[self._b]
        return self._pair(ya - as_dtype(self._f(yb), ya.dtype), yb)

    def reconstruct(self, y: Activation) -> tuple[tuple[Tensor, Tensor], Tape]:
        ya, yb = y[self._a], y[self._b]
        with enable_grad():
            xb_leaf = _leaf(yb)
            f = self._f(xb_leaf)
        return self._pair(_undo(ya, f), _plain(yb)), _HalfTape(xb_leaf, f, self.F, self._pair)


class _HalfTape(Tape):
    """dxa = dya;  dxb = dyb + F'(xb)^T dya  (a: the stream updated, b: the stream read)."""

    def __init__(self, xb: Tensor, f: Tensor, F: nn.Module,
                 pair: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]) -> None:
        self.xb, self.f, self.F, self.pair = xb, f, F, pair

    def backward(self, dy: Activation) -> tuple[Tensor, Tensor]:
        dya, dyb = self.pair(*dy)
        dxb = add_grad(dyb, vjp_into(self.f, dya, self.xb, self.F))
        self.xb = self.f = self.F = None
        return self.pair(dya, dxb)

"""A stage's gradients in one flat buffer per device and dtype, each parameter's ``.grad`` a view of it.

A stage checks its accumulated gradients for NaN / Inf after every backward and clears them after every step.
As views of one buffer, each is one op on the buffer instead of one per parameter (DeepSpeed's contiguous
gradients, torch DDP's ``gradient_as_bucket_view``). Accumulation adds into ``.grad`` in place, so the views
stay views; a ``.grad`` that something replaced (``zero_grad(set_to_none=True)``, a checkpoint load) is
noticed, and :meth:`GradBuffer.attach` makes it a view again with its values kept. Each view is laid out as its
parameter is (a channels-last weight's too), as autograd lays out a gradient: torch's fused optimizers rely on it.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch import Tensor

from ..nn.accumulate import GRAD, REQUIRES_GRAD
from ..util.grad_mode import no_grad


class GradBuffer:
    """The gradients of ``params`` (trainable, each once) as views of flat buffers, zero to begin with."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self.params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self.flats: list[Tensor] = []
        self.views: list[Tensor] = [torch.empty(0)] * len(self.params)
        for (device, dtype), members in groups.items():
            flat = torch.zeros(sum(self.params[i].numel() for i in members), dtype=dtype, device=device)
            offset = 0
            for i in members:
                self.views[i] = _grad_view(flat, offset, self.params[i])
                offset += self.params[i].numel()
            self.flats.append(flat)
        #: where each view starts and each parameter's strides, as built (``intact`` compares)
        self._pointers = list(map(Tensor.data_ptr, self.views))
        self._strides = list(map(Tensor.stride, self.params))
        self.attach()

    def covers(self, params: Sequence[Tensor]) -> bool:
        """Whether the buffer holds exactly ``params``, in that order."""
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))

    def intact(self) -> bool:
        """Whether each view is still where it was built and each parameter laid out as it was: ``Module.to`` to another
        memory format or dtype gives a parameter and its ``.grad`` new storage in place, the ``.grad`` object kept."""
        return list(map(Tensor.data_ptr, self.views)) == self._pointers and \
            list(map(Tensor.stride, self.params)) == self._strides

    def attached(self) -> bool:
        """Whether every parameter's ``.grad`` is its view."""
        return all(map(operator.is_, map(GRAD, self.params), self.views))

    def attach(self) -> None:
        """Make every parameter's ``.grad`` its view again, keeping its value (None: zero)."""
        with no_grad():
            for p, view in zip(self.params, self.views):
                if p.grad is view:
                    continue
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def zero_(self) -> None:
        """Every gradient to zero, attached."""
        for flat in self.flats:
            flat.zero_()
        if not self.attached():
            for p, view in zip(self.params, self.views):
                p.grad = view

    def tensors(self) -> list[Tensor]:
        """The gradients as few tensors as they are held: the flat buffers when attached, else each ``.grad``."""
        if self.attached():
            return self.flats
        return [g for p in self.params if (g := p.grad) is not None]


def gradient_strides(param: Tensor) -> tuple[int, ...]:
    """The strides autograd gives ``param``'s gradient: the parameter's own where it is dense (a channels-last weight
    included), else contiguous (``empty_like``'s rule). So they differ from ``param.stride()`` exactly where the
    parameter is not dense."""
    return torch.empty_like(param, device="meta").stride()


def _grad_view(flat: Tensor, offset: int, param: Tensor) -> Tensor:
    """``param``'s gradient as the view of ``flat`` from ``offset``, laid out by :func:`gradient_strides`. torch's
    fused optimizers pair a parameter's elements with its gradient's in memory order: a contiguous gradient of a
    channels-last weight would update it with its gradient permuted."""
    return flat.as_strided(param.shape, gradient_strides(param), flat.storage_offset() + offset)


class StageGrads:
    """A stage's gradients: those of the parameters its step updates (``stepped``) in a :class:`GradBuffer`,
    the others (a reader's copies of tied weights) as autograd leaves them."""

    def __init__(self, params: Sequence[Tensor], stepped: Sequence[Tensor]) -> None:
        self.params, self.stepped = list(params), list(stepped)
        self._build()

    def _build(self) -> None:
        self.buffer = GradBuffer([p for p in self.stepped if p.requires_grad])
        held = {id(p) for p in self.buffer.params}
        self._unbuffered = [p for p in self.params if id(p) not in held]

    def _current(self) -> bool:
        """Whether the buffer still holds the stepped parameters that train (none frozen or unfrozen since)."""
        return self.buffer.covers(list(filter(REQUIRES_GRAD, self.stepped)))

    def tensors(self) -> list[Tensor]:
        """Every gradient accumulated since the last step, as few tensors as they are held (what a check reduces)."""
        return self.buffer.tensors() + [g for p in self._unbuffered if (g := p.grad) is not None]

    def stepped_tensors(self) -> list[Tensor]:
        """The gradients the stage's step applies (clips, checks), as few tensors as they are held."""
        if self._current():
            return self.buffer.tensors()
        return [g for p in self.stepped if (g := p.grad) is not None]

    def for_step(self) -> None:
        """Before a step: every parameter that trains has a gradient (zero where no backward reached it), and a
        frozen one has none, so that the optimizer skips it (a zero gradient would still move it by its momentum
        or weight decay). A module moved to another layout or dtype since the buffer was built gets a buffer laid out
        anew, its gradients kept, before anything of the step reads them."""
        if not self.buffer.intact():
            self._build()
        if not self._unbuffered and self._current() and self.buffer.attached():
            return  # every parameter is in the buffer and trains, and has its view
        for p in self.params:
            if not p.requires_grad:
                p.grad = None
            elif p.grad is None:
                p.grad = torch.zeros_like(p)

    def attach(self) -> None:
        """After something replaced gradients (a checkpoint load): views again, values kept."""
        self.buffer.attach()

    def clear(self) -> None:
        """After a step: the stepped parameters' gradients to zero (the buffer rebuilt for the parameters that
        train now, if that changed), the others' to None."""
        if self._current():
            self.buffer.zero_()
            for p in self._unbuffered:
                p.grad = None
        else:  # every applied gradient dropped first: the new buffer keeps none of them
            for p in self.params:
                p.grad = None
            self._build()

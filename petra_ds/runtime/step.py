"""One stage's optimizer step as one unit (the ``AccumulateAndStep`` instruction), in the order it must run.

After a stage's k-th backward since its last step: under fp16 its gradients are unscaled, they are averaged over
its data-parallel replicas, a reader of tied weights hands its gradient to their owner and the owner adds its
readers', the gradients are clipped over the stage's own parameters and checked for NaN / Inf (one reduction: the
clipping norm is the check; under fp16 it also sets the next loss scale), delay compensation takes the optimizer's
step (or the step is skipped), the gradients are cleared, the owner's new tied weights go to their readers, the LR
scheduler steps. The engine runs this unit and carries what it returns; the unit reaches the engine only through
the callables it was given.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..nn.batchnorm import running_stat_tensors
from ..nn.casts import weights_written
from ..pipeline.ties import TiedWeights
from ..schedule.channels import Key
from .finite import FiniteWatch, fresh_momentum, skips_on_device
from .stage import Stage

#: what a step produces for other stages: messages by key (tied gradients and weights)
Messages = dict[Key, tuple]


class StageStep:
    """Stage ``stage``'s optimizer step. ``average`` (None without data parallelism) averages tensors over
    the stage's replicas; ``take`` pops a received message (None when none came); ``notify`` calls the
    observers' ``before_step`` / ``after_step`` hooks."""

    def __init__(self, stage: Stage, optimizer: Any, scheduler: Any, *, clipping: float, finite: FiniteWatch,
                 non_finite: str, ties: TiedWeights, average: Callable[[list[Tensor], str], None] | None,
                 take: Callable[[Key], tuple | None], notify: Callable[..., None]) -> None:
        self.stage, self.optimizer, self.scheduler = stage, optimizer, scheduler
        self.clipping, self.finite, self.non_finite, self.ties = clipping, finite, non_finite, ties
        self.average, self.take, self.notify = average, take, notify
        self.skips_on_device = optimizer is not None and skips_on_device(optimizer)
        #: a fused SGD's first momentum step is not skipped on the device (``finite.fresh_momentum``)
        self._fresh_momentum = self.skips_on_device and fresh_momentum(optimizer)
        #: optimizer steps taken (skipped ones included), the schedule's count
        self.steps = 0

    def __call__(self, step: int) -> Messages:
        """Take the stage's ``step``-th step (1-based); returns the messages it produced."""
        st, j = self.stage, self.stage.index
        st.grads.for_step()  # asked at each step: a layer may be frozen later
        scale = st.loss_scale
        if self.average is not None or self.ties or scale.scales:  # they rewrite the gradients the backwards reported
            self.finite.flush_gradients()
        scale.unscale_(st.grads.tensors())  # fp16: before anything reads them
        if self.average is not None:
            self.average(st.grads.tensors() + running_stat_tensors(st.norms),
                         f"the data-parallel reduction of stage {j}")
        produced: Messages = dict(self.ties.gradients(j, step, self.take))
        norm = None
        grads = st.grads.stepped_tensors()
        if self.clipping > 0:  # its total norm is the step's finite check
            norm = torch.nn.utils.get_total_norm(grads)  # torch's clip_grad_norm_, the norm taken of the flat buffers
            torch.nn.utils.clip_grads_with_norm_(st.stepped, self.clipping, norm)
        found_inf = self.finite.step(j, step, st.last_micro_batch, grads, norm)
        unhandled = None if found_inf is None else scale.update(found_inf)
        if unhandled is not None:  # dynamic loss scaling
            self.finite.overflow_at_minimum(j, step, st.last_micro_batch, unhandled)
        on_device = self.skips_on_device
        if on_device and self._fresh_momentum:
            self._fresh_momentum = fresh_momentum(self.optimizer)
            on_device = not self._fresh_momentum
        # a host read, only for an optimizer that cannot skip on the device
        finite = found_inf is None or on_device or not bool(found_inf)
        if not finite and self.non_finite == "raise":
            self.finite.check()
        self.notify("before_step", j, step)
        if self.optimizer is not None and finite:
            if on_device:
                self.optimizer.found_inf = found_inf
            st.compensation.step(self.optimizer.step, self.optimizer, step)
            weights_written()
        self.notify("after_step", j, step)
        st.grads.clear()  # not optimizer.zero_grad(): DeepSpeed's fused optimizers differ in signature
        produced.update(self.ties.weights(j, step))
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1
        if self.steps != step:
            raise RuntimeError(f"stage {j} took step {self.steps}, the schedule says {step}")
        return produced

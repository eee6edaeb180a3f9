"""Delay compensation: what stage j does about its gradients arriving tau_j = 2(J-1-j) clocks late.

Stage j runs micro-batch m's forward at one clock and its backward tau_j clocks later, with the
parameters as they are then; about s_j = tau_j / k optimizer steps of that stage fall in between. Plain
PETRA (the paper, ``"none"``) applies the gradient as it comes. The methods below are from the
asynchronous-pipeline literature, chosen because they respect PETRA's constraint: nothing is kept per
micro-batch in flight (no weight stash), at most one extra parameter-sized buffer per stage.

- ``"weight_prediction"`` (SpecTrain, Chen et al. 2018; PipeMare's discrepancy correction, Yang et al.
  2021, turned forward in time): the forward runs with ``w + scale * s_j * d``, where ``d`` is the stage's
  last update (``beta`` > 0: an exponential average of its updates). The weights the forward uses then
  approximate the ones its backward will use, so the gradient is less stale and a reversible stage
  reconstructs its input from weights close to the forward's. One persistent buffer ``d`` per stage
  (like an optimizer moment) and one temporary (the predicted weights during a forward, or the
  weights before a step while ``d`` is formed).
- ``"lr_rescale"`` (PipeMare's learning-rate rescheduling, Yang et al. 2021): stage j's step size is
  ``lr * max(1, s_j) ** -p_t`` with ``p_t = max(0, 1 - (t - 1) / anneal_steps)`` at its step t: delayed stages
  start with a step size divided by their delay and reach the schedule's after ``anneal_steps``.
  No buffer at all.
- ``"adaptive_momentum"`` (the delay-adaptive momentum of Ajanthan et al., ICML 2025, with their delay in
  stages replaced by PETRA's delay in optimizer steps): stage j's first momentum coefficient (Adam's beta1,
  SGD's momentum) becomes ``b + (beta1_max - b) * s_j / (s_0 + 1)``, ``b`` the configured one; the most
  delayed stage averages over the longest horizon. Meant for a Nesterov optimizer such as NAdam, whose
  gradient weight ``1 - beta1`` then shrinks where the gradient is stalest. No buffer at all.
- ``"error_feedback"`` (the error-feedback correction of Zmushko et al., ICML 2026, for a delay of s_j steps):
  after the optimizer moves the weights by ``u_t``, the stage adds ``c (u_t - u_{t-1})``, ``c = scale * s_j``,
  ``u_0 = 0``. The error of a delayed step is the displacement the stage has not caught up, about ``s_j u``;
  feeding its change back keeps the weights ``c u_t`` ahead of the trajectory the updates alone trace, so each
  gradient, computed s_j steps ago at the shifted weights, was computed near the unshifted weights it updates.
  Unlike weight prediction it moves the weights themselves, so forward, backward and reconstruction all
  use them. One persistent buffer ``u_{t-1}`` per stage and one temporary during a step. The paper gives the
  principle (update-level, optimizer-agnostic, one gradient-sized buffer); this rule is our derivation of it.

With ``"synchronous_steps": N`` the first N ``train_batch`` calls run without delay (``AfterSynchronousSteps``):
every method waits through them, as on the last stage, and counts its steps from the first delayed one.

Methods combine as a list, ``["weight_prediction", "adaptive_momentum"]``: the first one's forward weights
and step wrap the next one's. The last stage has s_j = 0: every method leaves it as it is.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, fields
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from ..nn.casts import weights_written
from ..schedule import delay
from ..util.checks import positive_int
from ..util.grad_mode import no_grad

METHODS = ("none", "weight_prediction", "lr_rescale", "adaptive_momentum", "error_feedback")


class DelayCompensationError(ValueError):
    """A ``"petra": {"delay_compensation": ...}`` value that cannot run; the message says what to change."""


@dataclass(frozen=True)
class DelayCompensation:
    """Parsed ``"petra": {"delay_compensation": ...}``: a method name, or ``{"method": ..., params}``."""

    method: str = "none"
    #: weight_prediction: the extrapolation is ``scale * s_j`` updates ahead; error_feedback: the weights are
    #: kept ``scale * s_j`` updates ahead
    scale: float = 1.0
    #: weight_prediction: d is an exponential average of the updates with this decay (0: the last update)
    beta: float = 0.0
    #: lr_rescale: optimizer steps over which a delayed stage's step size returns to the schedule's
    anneal_steps: int = 100
    #: adaptive_momentum: the momentum coefficient a stage s_0 + 1 steps behind would get
    beta1_max: float = 0.99

    @classmethod
    def parse(cls, value: Any) -> "DelayCompensation | Combined":
        if isinstance(value, (DelayCompensation, Combined)):
            return value
        if value is None:
            return cls()
        if isinstance(value, (list, tuple)):
            if not all(isinstance(v, (str, Mapping)) for v in value):
                raise DelayCompensationError(
                    f'"petra.delay_compensation" as a list holds method names or objects such as '
                    f'{{"method": "weight_prediction"}}, got {value!r}')
            return Combined.of([cls.parse(v) for v in value])
        if isinstance(value, str):
            value = {"method": value}
        if not isinstance(value, Mapping):
            raise DelayCompensationError(
                f'"petra.delay_compensation" must be a method name {METHODS}, an object such as '
                f'{{"method": "weight_prediction", "scale": 1.0}} or a list of them, got {value!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise DelayCompensationError(
                f'unknown key(s) {unknown} in "petra.delay_compensation"; the known keys are {sorted(known)}')
        parsed = cls(**value)
        parsed.validate()
        return parsed

    def validate(self) -> None:
        if self.method not in METHODS:
            raise DelayCompensationError(
                f'"petra.delay_compensation.method" must be one of {METHODS}, got {self.method!r}')
        if not _number(self.scale) or self.scale < 0:
            raise DelayCompensationError(
                f'"petra.delay_compensation.scale" must be a number >= 0, got {self.scale!r}')
        if not _number(self.beta1_max) or not 0 <= self.beta1_max < 1:
            raise DelayCompensationError(
                f'"petra.delay_compensation.beta1_max" must be in [0, 1), got {self.beta1_max!r}')
        if not _number(self.beta) or not 0 <= self.beta < 1:
            raise DelayCompensationError(
                f'"petra.delay_compensation.beta" must be in [0, 1), got {self.beta!r}')
        positive_int(self.anneal_steps, '"petra.delay_compensation.anneal_steps"', DelayCompensationError)

    def for_stage(self, params: Sequence[Tensor], stage: int, petra_stages: int, k: int) -> "StageCompensation":
        """The per-stage object for ``stage`` of ``petra_stages`` stepping every ``k`` micro-batches: its
        gradients are s_j = tau_j / k optimizer steps late, the first stage's s_0."""
        steps_behind, most_behind = delay(stage, petra_stages) / k, delay(0, petra_stages) / k
        if self.method == "weight_prediction" and steps_behind > 0:
            return WeightPrediction(params, self.scale * steps_behind, self.beta)
        if self.method == "lr_rescale" and steps_behind > 0:
            return LrRescale(steps_behind, self.anneal_steps)
        if self.method == "adaptive_momentum" and steps_behind > 0:
            return AdaptiveMomentum(steps_behind / (most_behind + 1), self.beta1_max)
        if self.method == "error_feedback" and steps_behind > 0 and self.scale > 0:
            return ErrorFeedback(params, self.scale * steps_behind)
        return NoCompensation()


@dataclass(frozen=True)
class Combined:
    """Several methods at once, applied in the order given (``"delay_compensation": [a, b]``)."""

    parts: tuple[DelayCompensation, ...]

    @classmethod
    def of(cls, parts: Sequence[DelayCompensation | "Combined"]) -> "DelayCompensation | Combined":
        flat = [p for part in parts for p in (part.parts if isinstance(part, Combined) else (part,))]
        flat = [p for p in flat if p.method != "none"]
        names = [p.method for p in flat]
        if len(set(names)) != len(names):
            raise DelayCompensationError(
                f'"petra.delay_compensation" names a method twice ({names}); give each method once, with all '
                "its parameters in one object")
        if len(flat) < 2:
            return flat[0] if flat else DelayCompensation()
        return cls(tuple(flat))

    @property
    def method(self) -> str:
        return "+".join(p.method for p in self.parts)

    def for_stage(self, params: Sequence[Tensor], stage: int, petra_stages: int, k: int) -> "StageCompensation":
        return Chain([p.for_stage(params, stage, petra_stages, k) for p in self.parts])


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class StageCompensation:
    """What a delay compensation does at one stage: the weights its forward runs with and how it takes an
    optimizer step. The methods override what they change; :class:`NoCompensation` changes nothing."""

    def forward_weights(self) -> ContextManager[None]:
        """The weights a forward runs with (entered around the stage's forward only)."""
        return nullcontext()

    def step(self, optimizer_step: Callable[[], Any], optimizer: Any, step: int) -> None:
        """Take the stage's ``step``-th optimizer step (1-based)."""
        optimizer_step()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


class NoCompensation(StageCompensation):
    """``"none"``, plain PETRA: the forward uses the current weights, the optimizer steps as configured."""


def _restored(saved: Sequence[Tensor] | None, params: Sequence[Tensor]) -> list[Tensor] | None:
    """A checkpoint's per-parameter buffer, copied onto its parameters' devices (None stays None)."""
    return None if saved is None else [t.to(p.device).clone() for t, p in zip(saved, params)]


def _step_and_update(params: Sequence[Tensor], optimizer_step: Callable[[], Any]) -> tuple[list[Tensor], list[Tensor]]:
    """Take the optimizer step; returns the weights (as tensors the step wrote) and what it added to them."""
    weights = [p.detach() for p in params]
    before = torch._foreach_mul(weights, 1.0)
    optimizer_step()
    return weights, torch._foreach_sub(weights, before)


class WeightPrediction(StageCompensation):
    """Forward with ``w_hat = w + ahead * d``; ``d`` is the stage's (averaged) last update (a step a fused
    optimizer skipped on the device for a non-finite gradient is an update of zero)."""

    def __init__(self, params: Sequence[Tensor], ahead: float, beta: float) -> None:
        self.params = list(params)
        self.ahead = ahead
        self.beta = beta
        self.d: list[Tensor] | None = None  # None until the first step: nothing to extrapolate yet

    @contextmanager
    def forward_weights(self) -> Iterator[None]:
        """``w_hat`` written into the weights' own storage and ``w`` written back after (a CUDA graph reads the
        storage it was captured with), through ``.data``: autograd's version counts do not move, so a tape that
        saved a weight earlier in the clock still finds ``w`` there at its backward."""
        if self.d is None or self.ahead == 0:
            yield
            return
        weights = [p.data for p in self.params]
        stored = [torch.empty_like(w) for w in weights]
        with no_grad():  # multi-tensor ops for the stage
            torch._foreach_copy_(stored, weights)
            torch._foreach_add_(weights, torch._foreach_mul(self.d, self.ahead))
        weights_written()
        try:
            yield
        finally:
            with no_grad():
                torch._foreach_copy_(weights, stored)
            weights_written()

    def step(self, optimizer_step: Callable[[], Any], optimizer: Any, step: int) -> None:
        with no_grad():  # multi-tensor ops: a few ops per step for the stage, not a few per tensor
            _, update = _step_and_update(self.params, optimizer_step)
            if self.d is None or self.beta == 0:
                self.d = update
            else:
                torch._foreach_mul_(self.d, self.beta)
                torch._foreach_add_(self.d, update, alpha=1 - self.beta)

    def state_dict(self) -> dict:
        """The averaged update itself, not a copy: a checkpoint writes it at once, and the memory report
        counts it without allocating it twice."""
        return {"d": self.d}

    def load_state_dict(self, state: dict) -> None:
        self.d = _restored(state.get("d"), self.params)


class ErrorFeedback(StageCompensation):
    """After each step, ``w += ahead * (u_t - u_{t-1})`` with ``u_t`` the step's update (``u_0 = 0``); a step a
    fused optimizer skipped on the device is an update of zero."""

    def __init__(self, params: Sequence[Tensor], ahead: float) -> None:
        self.params = list(params)
        self.ahead = ahead
        self.last: list[Tensor] | None = None  # u_{t-1}; None before the first step (zero)

    def step(self, optimizer_step: Callable[[], Any], optimizer: Any, step: int) -> None:
        with no_grad():  # a few multi-tensor ops for the stage
            weights, update = _step_and_update(self.params, optimizer_step)
            change = update if self.last is None else torch._foreach_sub(update, self.last)
            torch._foreach_add_(weights, change, alpha=self.ahead)
            self.last = update

    def state_dict(self) -> dict:
        """The last update itself, not a copy (as :meth:`WeightPrediction.state_dict`)."""
        return {"last": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.last = _restored(state.get("last"), self.params)


class LrRescale(StageCompensation):
    """PipeMare's step size ``lr * max(1, s) ** -p_t``, ``p_t = max(0, 1 - (t - 1) / anneal_steps)``."""

    def __init__(self, steps_behind: float, anneal_steps: int) -> None:
        self.delay = max(1.0, steps_behind)
        self.anneal_steps = anneal_steps

    def factor(self, step: int) -> float:
        """The multiplier of the scheduled learning rate at the stage's ``step``-th step (1-based)."""
        p = max(0.0, 1.0 - (step - 1) / self.anneal_steps)
        return self.delay ** -p

    def step(self, optimizer_step: Callable[[], Any], optimizer: Any, step: int) -> None:
        groups = optimizer.param_groups
        scheduled = [g["lr"] for g in groups]
        factor = self.factor(step)
        for g in groups:
            g["lr"] = g["lr"] * factor
        try:
            optimizer_step()
        finally:  # the scheduler owns the learning rate: give it back what it set
            for g, lr in zip(groups, scheduled):
                g["lr"] = lr


class AdaptiveMomentum(StageCompensation):
    """The stage's first momentum coefficient moved ``fraction`` of the way from the configured one ``b`` to
    ``beta1_max``: ``b + (beta1_max - b) * fraction``, ``fraction = s_j / (s_0 + 1)``.

    ``b`` is kept in each parameter group (``"configured_beta1"``), so it is checkpointed with the
    optimizer and a resumed run does not move an already moved coefficient again."""

    def __init__(self, fraction: float, beta1_max: float) -> None:
        self.fraction = fraction
        self.beta1_max = beta1_max

    def beta1(self, configured: float) -> float:
        return configured + (self.beta1_max - configured) * self.fraction

    def step(self, optimizer_step: Callable[[], Any], optimizer: Any, step: int) -> None:
        for group in optimizer.param_groups:
            if "betas" in group:
                b = group.setdefault("configured_beta1", group["betas"][0])
                group["betas"] = (self.beta1(b), *group["betas"][1:])
            elif "momentum" in group:
                b = group.setdefault("configured_beta1", group["momentum"])
                group["momentum"] = self.beta1(b)
            else:
                raise DelayCompensationError(
                    f'"adaptive_momentum" needs an optimizer with "betas" or "momentum", and '
                    f"{type(optimizer).__name__} has neither; use another delay compensation")
        optimizer_step()


class Chain(StageCompensation):
    """Several stage compensations: the first one's forward weights and step wrap the next one's."""

    def __init__(self, parts: Sequence[StageCompensation]) -> None:
        self.parts = list(parts)

    @contextmanager
    def forward_weights(self) -> Iterator[None]:
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.forward_weights())
            yield

    def step(self, optimizer_step: Callable[[], Any], optimizer: Any, step: int) -> None:
        take = optimizer_step
        for part in reversed(self.parts):
            take = (lambda part, inner: lambda: part.step(inner, optimizer, step))(part, take)
        take()

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        for part, s in zip(self.parts, state.get("parts", [{}] * len(self.parts))):
            part.load_state_dict(s)


class AfterSynchronousSteps(StageCompensation):
    """A stage's compensation under ``"synchronous_steps"`` N: the stage's step s holds the micro-batches of
    ``train_batch`` call s (each call feeds k), so steps 1..N hold those of the synchronous calls, whose gradients are
    not late: the optimizer steps as configured. Later steps run the method, counted from the first delayed one.
    Every method's forward acts on what its steps kept (weight prediction's d), so its forwards wait too. Its state
    is the method's."""

    def __init__(self, method: StageCompensation, synchronous_steps: int) -> None:
        self.method = method
        self.synchronous_steps = synchronous_steps

    def forward_weights(self) -> ContextManager[None]:
        return self.method.forward_weights()

    def step(self, optimizer_step: Callable[[], Any], optimizer: Any, step: int) -> None:
        if step <= self.synchronous_steps:
            optimizer_step()
        else:
            self.method.step(optimizer_step, optimizer, step - self.synchronous_steps)

    def state_dict(self) -> dict:
        return self.method.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.method.load_state_dict(state)

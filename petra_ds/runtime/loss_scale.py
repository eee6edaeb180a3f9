"""fp16's loss scaling, one scale per stage: what ``"fp16": {"enabled": true}`` means for PETRA.

Under fp16 autocast a gradient smaller than about 6e-8 rounds to zero, so backprop multiplies the loss by a scale s
and divides the gradients by it before the step. DeepSpeed keeps one s for the whole model and lowers it when any
gradient overflowed, which needs an overflow check across every stage at one step; PETRA's stages step at different
clocks. So each stage keeps its own s_j, and every message stays unscaled between stages:

- the last stage backpropagates (loss / k) * s_{J-1}; any other stage multiplies the delta it receives by s_j
  before its VJP;
- a stage divides the input gradient it sends by s_j, and its step divides its parameters' gradients by s_j before
  anything reads them (data-parallel average, tied weights, clipping, the optimizer);
- s_j changes only at stage j's own step, so the k micro-batches a step accumulates share one scale. Scales are
  powers of two: scaling and unscaling are exact, and a run's updates do not depend on s as long as no scaled
  value overflows fp16 or falls below its normal range (6.1e-5), where it keeps fewer digits.

Dynamic scaling (``"loss_scale": 0``) follows DeepSpeed's rule per stage, on the device (no host read): a step whose
gradients hold an Inf or NaN is skipped and lowers s_j (halved, after ``hysteresis`` such steps, not below
``min_loss_scale``); ``loss_scale_window`` steps without one double it. Such a skip is the scale's business, not an
error: the NaN watch counts it (``engine.skipped_steps``) and names only an overflow at the minimum scale, where no
lower scale can help. A fixed ``loss_scale`` never changes, and an overflow is a non-finite gradient as in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from ..nn.reversible import Activation, shaped_like


@dataclass(frozen=True)
class LossScaleConfig:
    """The ``"fp16"`` section's scaling keys (DeepSpeed's names and defaults)."""

    #: 0: dynamic scaling; else the fixed scale
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial(self) -> float:
        return float(2 ** self.initial_scale_power) if self.dynamic else float(self.loss_scale)

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> "LossScaleConfig":
        """Parsed and checked by DeepSpeed's own model of the section; what PETRA cannot take raises ``ValueError``."""
        from deepspeed.runtime.precision_config import DeepSpeedFP16Config

        parsed = DeepSpeedFP16Config(**section)
        if parsed.auto_cast:
            raise ValueError('"fp16.auto_cast" casts the inputs to fp16, and PETRA keeps the streams between its '
                             'stages in fp32 (autocast runs inside each stage): remove "auto_cast"')
        if parsed.fp16_master_weights_and_grads:
            raise ValueError('"fp16.fp16_master_weights_and_grads" is a ZeRO-Offload setting; PETRA keeps fp32 '
                             'parameters and gradients: remove it')
        if parsed.hysteresis < 1:
            raise ValueError(f'"fp16.hysteresis" must be at least 1, got {parsed.hysteresis}')
        config = cls(float(parsed.loss_scale), int(parsed.initial_scale_power), int(parsed.loss_scale_window),
                     int(parsed.hysteresis), bool(parsed.consecutive_hysteresis), float(parsed.min_loss_scale))
        scale = config.initial
        if not _power_of_two(scale) or (config.dynamic and not _power_of_two(config.min_loss_scale)):
            raise ValueError(f'"fp16": the loss scales must be powers of two (got loss_scale {parsed.loss_scale}, '
                             f'initial_scale_power {parsed.initial_scale_power}, min_loss_scale '
                             f"{parsed.min_loss_scale}): PETRA's stages unscale what they send, which is exact only "
                             "for a power of two")
        return config

    def describe(self) -> str:
        """One line for the settings print."""
        if not self.dynamic:
            return f"fp16, loss scale {self.loss_scale:g} per stage (fixed)"
        return (f"fp16, dynamic loss scale per stage from 2^{self.initial_scale_power} "
                f"(window {self.loss_scale_window}, hysteresis {self.hysteresis}, min {self.min_loss_scale:g})")


def _power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


class NoLossScale:
    """What a stage without fp16 scales by: nothing (the same calls as :class:`StageLossScale`'s on its path)."""

    #: whether a stage scales its gradients (fp16)
    scales = False

    def loss(self, loss: Tensor, k: int) -> Tensor:
        return loss / k

    def scaled(self, delta: Activation) -> Activation:
        return delta

    def unscaled(self, dx: Activation | None) -> Activation | None:
        return dx

    def unscale_(self, grads: list[Tensor]) -> None:
        pass

    def update(self, found_inf: Tensor) -> None:
        return None

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: Mapping[str, float] | None) -> None:
        """A checkpoint's scale means nothing without fp16."""


class StageLossScale:
    """Stage j's scale s_j and its dynamic state, as device tensors that only its step updates."""

    scales = True

    def __init__(self, config: LossScaleConfig, device: torch.device | str) -> None:
        self.config = config
        self.scale = torch.tensor(config.initial, dtype=torch.float32, device=device)
        self.inverse = torch.reciprocal(self.scale)
        #: overflows left before the scale is lowered (DeepSpeed's ``cur_hysteresis``)
        self.hysteresis = torch.tensor(float(config.hysteresis), device=device)
        #: where the next step stands in the window: 0 right after an overflow (and at the start), else 1 ..
        #: ``loss_scale_window``, and a step without overflow at ``loss_scale_window`` doubles the scale (DeepSpeed's
        #: "stable interval" s: 0 for s = 0, else (s - 1) mod window + 1)
        self.in_window = torch.zeros((), device=device)
        self._full_hysteresis = torch.full_like(self.hysteresis, float(config.hysteresis))

    def loss(self, loss: Tensor, k: int) -> Tensor:
        """What the last stage backpropagates: its micro-batch's share of the step's mean loss, times s_j."""
        return loss / k * self.scale

    def scaled(self, delta: Activation) -> Activation:
        """The delta a stage received, times s_j, for its VJP."""
        return _times(delta, self.scale)

    def unscaled(self, dx: Activation | None) -> Activation | None:
        """An input gradient the VJP made, divided by s_j, as the stage sends it."""
        return None if dx is None else _times(dx, self.inverse)

    def unscale_(self, grads: list[Tensor]) -> None:
        """Divide the parameters' gradients by s_j, in place (exact: s_j is a power of two)."""
        if grads:
            torch._foreach_mul_(grads, self.inverse)

    def update(self, found_inf: Tensor) -> Tensor | None:
        """After the step that ``found_inf`` (1.0: its gradients held an Inf or NaN, else 0.0) guarded: the next s_j,
        in place, in 17 scalar ops on the device. Returns a device bool, whether this overflow is not the scale's
        to handle: it came at the minimum scale, where no lower scale can help (None for a fixed scale: every
        overflow is a non-finite gradient then)."""
        c = self.config
        if not c.dynamic:
            return None
        lower = found_inf * torch.le(self.hysteresis, 1)  # 1.0: this overflow halves the scale
        unhandled = torch.logical_and(torch.le(self.scale, c.min_loss_scale), lower)
        good = 1 - found_inf
        grow = good * torch.eq(self.in_window, c.loss_scale_window)  # 1.0: this step doubles it
        # s + s x (1, -1/2 or 0): doubled, halved or kept, exactly (a power of two)
        self.scale.addcmul_(self.scale, torch.sub(grow, lower, alpha=0.5)).clamp_(min=c.min_loss_scale)
        torch.reciprocal(self.scale, out=self.inverse)
        self.hysteresis.sub_(found_inf - lower)  # an overflow that does not lower the scale uses one up
        # refilled to ``hysteresis`` (a weight of exactly 0 or 1 makes lerp exact)
        self.hysteresis.lerp_(self._full_hysteresis, good if c.consecutive_hysteresis else grow)
        self.in_window.remainder_(c.loss_scale_window).add_(1).mul_(good)
        return unhandled

    def value(self) -> float:
        """s_j now (a host read)."""
        return float(self.scale)

    def state_dict(self) -> dict[str, float]:
        return {"scale": float(self.scale), "hysteresis": float(self.hysteresis), "in_window": float(self.in_window)}

    def load_state_dict(self, state: Mapping[str, float] | None) -> None:
        """Continue from :meth:`state_dict` (None, from a run without fp16: the initial scale stays)."""
        if state is None:
            return
        for name in ("scale", "hysteresis", "in_window"):
            getattr(self, name).fill_(state[name])
        self.inverse.copy_(torch.reciprocal(self.scale))


def _times(values: Activation, factor: Tensor) -> Activation:
    """``values`` (a tensor or a tuple of them, None entries kept), each floating tensor multiplied by ``factor``: one
    multi-tensor op for a tuple (a coupling's two streams), one kernel on a GPU."""
    if isinstance(values, Tensor):
        return values * factor if values.is_floating_point() else values
    scaled = [t is not None and t.is_floating_point() for t in values]
    products = iter(torch._foreach_mul([t for t, s in zip(values, scaled) if s], factor) if any(scaled) else ())
    return shaped_like(values, [next(products) if s else t for t, s in zip(values, scaled)])

"""The ``"petra"`` section of a DeepSpeed config, and what PETRA cannot take from the rest of it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

INPUT_BUFFERS = ("non_reversible", "all")
BN_RUNNING_STATS = ("backward", "forward")
NON_FINITE = ("raise", "skip")


class PetraConfigError(ValueError):
    """A config value PETRA cannot run with; the message names the key and what to change."""


@dataclass(frozen=True)
class PetraConfig:
    """Parsed ``"petra"`` section (DESIGN.md section 3)."""

    stages_per_rank: int = 1
    input_buffer: str = "non_reversible"
    param_buffer: bool = False
    bn_running_stats: str = "backward"
    seed: int = 0
    #: a non-finite loss or gradient: "raise" (naming stage, micro-batch / step and clock) or "skip" the
    #: stage's update for that step; parameters are never overwritten with NaN
    non_finite: str = "raise"
    #: check every layer declared reversible once, on its first input (``inverse(forward(x)) == x``)
    check_reversible: bool = True
    #: every this many optimizer steps, compare PETRA's gradient with the delayed and the end-to-end
    #: gradient per stage (``petra_ds.analysis.gradient_quality``); 0 turns it off. A diagnostic: it does
    #: not change training, and a checkpoint may be resumed with another value
    gradient_quality_every: int = 0

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> "PetraConfig":
        section = dict(section or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise PetraConfigError(
                f'unknown key(s) {unknown} in the "petra" config section; the known keys are {sorted(known)}'
            )
        config = cls(**section)
        config.validate()
        return config

    def validate(self) -> None:
        if not isinstance(self.stages_per_rank, int) or isinstance(self.stages_per_rank, bool) \
                or self.stages_per_rank < 1:
            raise PetraConfigError(f'"petra.stages_per_rank" must be an integer >= 1, got {self.stages_per_rank!r}')
        if self.input_buffer not in INPUT_BUFFERS:
            raise PetraConfigError(f'"petra.input_buffer" must be one of {INPUT_BUFFERS}, got {self.input_buffer!r}')
        if not isinstance(self.param_buffer, bool):
            raise PetraConfigError(f'"petra.param_buffer" must be true or false, got {self.param_buffer!r}')
        if self.bn_running_stats not in BN_RUNNING_STATS:
            raise PetraConfigError(
                f'"petra.bn_running_stats" must be one of {BN_RUNNING_STATS}, got {self.bn_running_stats!r}')
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise PetraConfigError(f'"petra.seed" must be an integer, got {self.seed!r}')
        if self.non_finite not in NON_FINITE:
            raise PetraConfigError(f'"petra.non_finite" must be one of {NON_FINITE}, got {self.non_finite!r}')
        if not isinstance(self.check_reversible, bool):
            raise PetraConfigError(f'"petra.check_reversible" must be true or false, got {self.check_reversible!r}')
        every = self.gradient_quality_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise PetraConfigError(
                f'"petra.gradient_quality_every" must be an integer >= 0 (0: off), got {every!r}')


def split_config(config: Mapping[str, Any]) -> tuple[PetraConfig, dict[str, Any], bool]:
    """(PETRA's section, the config DeepSpeed's engine is built with, whether bf16 autocast is on).

    DeepSpeed would cast the model to bf16 and wrap the optimizer in a BF16 optimizer whose overflow
    check and gradient norm are collectives over every stage; PETRA keeps fp32 parameters and runs
    bf16 autocast itself, so the ``bf16`` section is taken out here.
    """
    config = dict(config)
    petra = PetraConfig.from_dict(config.pop("petra", None))
    bf16 = dict(config.pop("bf16", None) or {})
    bf16_enabled = bool(bf16.get("enabled", False))
    fp16 = config.get("fp16") or {}
    if fp16.get("enabled", False):
        raise PetraConfigError(
            '"fp16" is not supported with PETRA: loss scaling needs an overflow check across all stages, '
            'which stages that step at different clocks cannot run; use "bf16": {"enabled": true} instead')
    if float(config.get("gradient_clipping", 0.0) or 0.0) > 0.0:
        raise PetraConfigError(
            '"gradient_clipping" is not supported with PETRA: it clips by the global gradient norm, a '
            'collective across stages that step at different clocks; remove it (or set it to 0)')
    zero = config.get("zero_optimization") or {}
    if int(zero.get("stage", 0) or 0) != 0:
        raise PetraConfigError(
            f'"zero_optimization.stage" {zero.get("stage")} is not supported with PETRA: ZeRO partitions and '
            'reduces gradients across the whole model at one step; set it to 0')
    gas = config.get("gradient_accumulation_steps", 1)
    if isinstance(gas, int) and gas < 1:
        raise PetraConfigError(f'"gradient_accumulation_steps" (PETRA\'s k) must be >= 1, got {gas}')
    return petra, config, bf16_enabled

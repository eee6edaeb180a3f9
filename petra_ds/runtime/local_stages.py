"""The PETRA stages one rank hosts, and what they share: their step units, their tied weights, their NaN watch.

The engine runs an instruction on one stage (``stages[j].forward(...)``); what spans the rank's stages it
asks of this object: what a clock runs under (the bf16 casts of the weights, shared by the clock's
evaluations), a stage's optimizer step (``runtime/step.py``), the tied weights a commit received,
the NaN watch's reduction at the end of a clock and its read at the end of a window, and the in-flight
state a checkpoint keeps. Built once, in the engine's constructor, with everything each stage needs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch
from deepspeed.runtime.pipe.module import PipelineModule
from torch import Tensor

from ..nn.casts import clock_casts
from ..nn.window import Lasting, modules_fixed
from ..pipeline.module import stage_layers
from ..pipeline.ties import TiedWeights
from ..schedule.channels import Key
from .compensation import AfterSynchronousSteps
from .config import PetraConfig
from .finite import FiniteWatch
from .loss_scale import LossScaleConfig, NoLossScale, StageLossScale
from .stage import Stage, StageOptions
from .step import Messages, StageStep


class LocalStages(Mapping[int, Stage]):
    """This rank's stages by index (a read-only mapping), with their step units, ties and NaN watch."""

    def __init__(self, module: PipelineModule, local: range, petra_stages: int, options: StageOptions,
                 config: PetraConfig, ties: TiedWeights, optimizers: Sequence[Any], schedulers: Sequence[Any], *,
                 reversible: Sequence[bool], clipping: float, clock: Callable[[], int],
                 average: Callable[[list[Tensor], str], None] | None, take: Callable[[Key], tuple | None],
                 notify: Callable[..., None], loss_scale: LossScaleConfig | None = None,
                 device: torch.device | str = "cpu") -> None:
        """``clock`` returns the clock running now; ``average``, ``take`` and ``notify`` are the engine's
        (see :class:`StageStep`); ``loss_scale``: fp16's, each stage's scale kept on ``device``."""
        #: what the stages read and make, checked for NaN / Inf on the device, read once per window
        self.finite = FiniteWatch(clock, local, petra_stages, check_finite=config.check_finite,
                                  non_finite=config.non_finite, scaled=loss_scale is not None and loss_scale.dynamic)
        self.ties = ties
        self._stages: dict[int, Stage] = {}
        for j in local:
            last = j == petra_stages - 1
            stage = Stage(j, petra_stages, stage_layers(module, j), options,
                          loss_fn=module.loss_fn if last else None, finite=self.finite,
                          compensation=config.delay_compensation, not_stepped=ties.reader_ids(j),
                          loss_scale=NoLossScale() if loss_scale is None else StageLossScale(loss_scale, device))
            if config.synchronous_steps:
                stage.compensation = AfterSynchronousSteps(stage.compensation, config.synchronous_steps)
            if stage.reversible != reversible[j]:
                raise TypeError(f"stage {j}: its built layers and their specs disagree on reversibility")
            self._stages[j] = stage
        self._steps = {j: StageStep(st, optimizers[i], schedulers[i], clipping=clipping, finite=self.finite,
                                    non_finite=config.non_finite, ties=ties, average=average, take=take,
                                    notify=notify)
                       for i, (j, st) in enumerate(self._stages.items())}
        self._lasting = Lasting(module for st in self._stages.values() for module in st.modules)

    def __getitem__(self, stage: int) -> Stage:
        return self._stages[stage]

    def __iter__(self) -> Iterator[int]:
        return iter(self._stages)

    def __len__(self) -> int:
        return len(self._stages)

    # --- what the engine asks during a window ---

    def step(self, stage: int, step: int) -> Messages:
        """Stage ``stage``'s ``step``-th optimizer step; returns the messages it produced (tied weights)."""
        return self._steps[stage](step)

    def receive(self, received: dict[Key, tuple]) -> dict[Key, tuple]:
        """What a commit received: the owners' new tied weights replace the readers' copies now; the rest
        is returned for the inbox."""
        if not self.ties:  # every clock commits: no scan of what arrived for models without ties
            return received
        weights = {key: value for key, value in received.items() if self.ties.is_weights(key)}
        self.ties.apply(weights)
        return {key: value for key, value in received.items() if key not in weights}

    def tie_specs(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """The ties as the schedule takes them (``PetraSchedule.for_window``'s ``ties``)."""
        return self.ties.specs()

    def window(self) -> ContextManager[None]:
        """What a training window runs under: its modules held still (``nn/window.py``), and what earlier windows
        worked out about them kept while they stay as they were."""
        return modules_fixed(self._lasting)

    @contextmanager
    def clock(self) -> Iterator[None]:
        """What a clock runs under: each weight's bf16 cast made once and read by all of the clock's evaluations."""
        with clock_casts():
            yield

    def end_clock(self) -> None:
        """Reduce what the stages reported during the clock, on the device (no host read)."""
        self.finite.flush()

    def checks(self) -> Tensor | None:
        """The window's NaN / Inf checks as one device vector (None if nothing was checked), for the read
        that also reads the window's loss."""
        return self.finite.take()

    def report(self, values: Sequence[float] | None) -> None:
        """Given the host values of :meth:`checks`: raise for the first non-finite one, or log it and go on
        (``non_finite``)."""
        if values is not None:
            self.finite.raise_or_log(self.finite.report(values))

    @property
    def skipped_steps(self) -> list[tuple[int, int]]:
        """(stage, step) of the updates skipped for non-finite gradients (``non_finite: "skip"``)."""
        return self.finite.skipped_steps

    def loss_scales(self) -> dict[int, float]:
        """fp16: each stage's loss scale now (host reads); empty without fp16."""
        return {j: st.loss_scale.value() for j, st in self._stages.items() if st.loss_scale.scales}

    @property
    def step_counts(self) -> dict[int, int]:
        """Optimizer steps each stage took (skipped ones included)."""
        return {j: step.steps for j, step in self._steps.items()}

    # --- checkpoints ---

    def stage_state(self, stage: int) -> dict[str, Any]:
        """Stage ``stage``'s in-flight state, its step count and its copies of tied weights: nothing that
        depends on which rank hosts it."""
        st = self._stages[stage]
        return {"state": st.state_dict(), "steps": self._steps[stage].steps,
                "tied_copies": self.ties.reader_state(stage, st.modules)}

    def load_stage_state(self, stage: int, state: dict[str, Any]) -> None:
        """Continue stage ``stage`` from :meth:`stage_state` (written by whichever rank hosted it)."""
        st = self._stages[stage]
        st.load_state_dict(state["state"])
        self._steps[stage].steps = state["steps"]
        self.ties.load_reader_state(stage, st.modules, state["tied_copies"])

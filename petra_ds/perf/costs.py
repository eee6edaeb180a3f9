"""What one micro-batch costs at each stage: the few measured seconds every instruction's duration is
built from. One record shared by the measurement, the simulator's programs and the predictions."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Costs", "StageCosts"]


@dataclass(frozen=True)
class StageCosts:
    """Measured seconds of one stage's primitives, for one micro-batch.

    ``backward_split``: the backward as DeepSpeed's ``PipelineEngine`` runs it at a stage whose output is
    several tensors (a reversible stage's pair): one ``backward(retain_graph=True)`` call per tensor,
    which walks the shared part of the graph again. ``None``: the same as ``backward``.
    """

    forward: float
    forward_grad: float
    backward: float
    step: float = 0.0
    backward_split: float | None = None

    @property
    def deepspeed_factor(self) -> float:
        """How much longer DeepSpeed's backward takes than one backward call (1 without a measurement)."""
        return 1.0 if self.backward_split is None else self.backward_split / self.backward


@dataclass(frozen=True)
class Costs:
    """Per-stage costs and the time of one activation-sized message between neighbouring ranks."""

    stages: tuple[StageCosts, ...]
    message_s: float = 0.0

    @property
    def stage_count(self) -> int:
        return len(self.stages)

    @classmethod
    def uniform(cls, stage_count: int, forward: float, forward_grad: float, backward: float,
                step: float = 0.0, message_s: float = 0.0) -> "Costs":
        return cls((StageCosts(forward, forward_grad, backward, step),) * stage_count, message_s)

    def stretched(self, stage_count: int) -> "Costs":
        """``stage_count`` stages made of the measured ones, each repeated in order (stage j of J takes
        measured stage j * M // J): a deeper model cut like the measured one, to predict past the J a
        benchmark ran. The first stage keeps the input's costs, the last the loss's."""
        M = self.stage_count
        return Costs(tuple(self.stages[j * M // stage_count] for j in range(stage_count)), self.message_s)

    def host_bound(self, host_s: float | Sequence[float], unit_s: Callable[[StageCosts, int, int], float]) -> "Costs":
        """The costs of ranks whose host needs ``host_s`` (one value, or one per stage) to issue one unit of a
        stage's work (``unit_s(costs, stage, stage_count)`` device seconds: what a schedule runs per stage and
        micro-batch) while the device runs it asynchronously: the unit then lasts max(device, host), the host's
        seconds spread over the unit's primitives in proportion to the device's. The step keeps its own cost."""
        hosts = [float(host_s)] * self.stage_count if isinstance(host_s, (int, float)) else list(host_s)
        if len(hosts) != self.stage_count:
            raise ValueError(f"host seconds for {len(hosts)} stages, costs for {self.stage_count}")
        stages = []
        for j, s in enumerate(self.stages):
            f = max(1.0, hosts[j] / unit_s(s, j, self.stage_count))
            stages.append(replace(s, forward=f * s.forward, forward_grad=f * s.forward_grad, backward=f * s.backward,
                                  backward_split=None if s.backward_split is None else f * s.backward_split))
        return Costs(tuple(stages), self.message_s)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Costs":
        """The ``"costs"`` entry of a benchmark report: ``{"stages": [{forward, forward_grad, backward,
        step[, backward_split]}, ...], "message_s": s}``."""
        stages = tuple(StageCosts(float(s["forward"]), float(s["forward_grad"]), float(s["backward"]),
                                  float(s.get("step", 0.0)),
                                  None if s.get("backward_split") is None else float(s["backward_split"]))
                       for s in data["stages"])
        return cls(stages, float(data.get("message_s", 0.0)))

    def to_dict(self) -> dict[str, Any]:
        stages = [{k: v for k, v in asdict(s).items() if v is not None} for s in self.stages]
        return {"stages": stages, "message_s": self.message_s}

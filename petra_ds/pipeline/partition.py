"""A cost-balanced partition: J contiguous stages that minimise the slowest stage's PETRA cost.

PETRA runs every stage once per clock, so the slowest stage sets the clock. What a stage runs per clock
depends on its place and its layers:

- a middle stage whose layers are all reversible (``schedule.reconstructs``) runs its forward without a
  graph, rebuilds input and graph by reconstruction, then runs the backward;
- any other stage but the last runs its forward without a graph, recomputes it with a graph from its
  kept input, then runs the backward;
- the last stage runs its forward with a graph and its backward in the same clock.

A backprop pipeline (1F1B, GPipe, zero bubble) runs each micro-batch's forward with a graph and its
backward on every stage (``rule="backprop"``); with activation checkpointing it also recomputes the
forward (``rule="backprop_ckpt"``). A baseline cut by PETRA's rule would be handicapped (PETRA's last
stage is cheaper per layer than its others), so each schedule is cut by its own rule.

``PetraPipelineModule(..., partition_method="profile", layer_costs=...)`` cuts the layers with
:func:`balanced_parts`. The result depends only on the costs, so every rank that reads the same costs
cuts the same way. ``petra_ds.perf.measure.measure_layer_costs`` measures them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

from ..util.files import write_text_atomic
from ..schedule import reconstructs


@dataclass(frozen=True)
class LayerCost:
    """Seconds per micro-batch of one layer: ``forward`` without a graph, ``forward_grad`` with one,
    ``backward`` through that graph, ``reconstruct`` rebuilding its input and graph from its output
    (None: the layer is not reversible)."""

    forward: float
    forward_grad: float
    backward: float
    reconstruct: float | None = None


#: what a stage runs per micro-batch: PETRA's clock, plain backprop, backprop with checkpointing
RULES = ("petra", "backprop", "backprop_ckpt")


def stage_cost(costs: Sequence[LayerCost], stage: int, petra_stages: int, input_buffer: str = "non_reversible",
               rule: str = "petra") -> float:
    """Seconds per micro-batch of stage ``stage`` made of the layers ``costs`` under ``rule``."""
    if rule not in RULES:
        raise ValueError(f"unknown partition rule {rule!r}; use one of {', '.join(RULES)}")
    backward = sum(c.backward for c in costs)
    if rule != "petra":
        passes = 2 if rule == "backprop_ckpt" else 1  # a checkpointed forward also runs with autograd on
        return passes * sum(c.forward_grad for c in costs) + backward
    if stage == petra_stages - 1:
        return sum(c.forward_grad for c in costs) + backward
    forward = sum(c.forward for c in costs)
    if reconstructs(stage, petra_stages, all(c.reconstruct is not None for c in costs), input_buffer):
        return forward + sum(c.reconstruct for c in costs) + backward
    return forward + sum(c.forward_grad for c in costs) + backward


def balanced_parts(costs: Sequence[LayerCost], petra_stages: int, input_buffer: str = "non_reversible",
                   rule: str = "petra") -> list[int]:
    """Layer boundaries ``[0, b_1, ..., len(costs)]`` of ``petra_stages`` non-empty contiguous stages that
    minimise the largest :func:`stage_cost` under ``rule`` (exact, by dynamic programming; among optimal
    cuts the one with the earliest boundaries)."""
    n = len(costs)
    if not 1 <= petra_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {petra_stages} non-empty stages")
    inf = float("inf")
    # best[j][i]: the smallest slowest-stage cost of layers [0, i) cut into stages 0..j-1; cut[j][i] its last boundary
    best = [[inf] * (n + 1) for _ in range(petra_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(petra_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, petra_stages + 1):
        for i in range(j, n - (petra_stages - j) + 1):
            for c in range(j - 1, i):
                if best[j - 1][c] == inf:
                    continue
                value = max(best[j - 1][c], stage_cost(costs[c:i], j - 1, petra_stages, input_buffer, rule))
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, c
    parts = [n]
    for j in range(petra_stages, 0, -1):
        parts.append(cut[j][parts[-1]])
    return parts[::-1]


def stage_costs(costs: Sequence[LayerCost], parts: Sequence[int], input_buffer: str = "non_reversible",
                rule: str = "petra") -> list[float]:
    """Each stage's :func:`stage_cost` under the cut ``parts`` (layer boundaries ``[0, ..., len(costs)]``)."""
    petra_stages = len(parts) - 1
    return [stage_cost(costs[a:b], j, petra_stages, input_buffer, rule) for j, (a, b) in enumerate(zip(parts, parts[1:]))]


def imbalance(costs: Sequence[LayerCost], parts: Sequence[int], input_buffer: str = "non_reversible",
              rule: str = "petra") -> float:
    """How far the cut ``parts`` is from equal stages: its slowest stage's cost over the mean of its stages'
    costs, minus 1 (0: perfectly even). With whole layers as the grain, a few layers per stage leave this well
    above 0 even at the best cut."""
    stages = stage_costs(costs, parts, input_buffer, rule)
    return max(stages) / (sum(stages) / len(stages)) - 1


def load_costs(source: str | Sequence[LayerCost | dict]) -> list[LayerCost]:
    """Layer costs from a list (of :class:`LayerCost` or dicts with their fields) or a JSON file holding one."""
    if isinstance(source, str):
        with open(source) as f:
            source = json.load(f)
    out = []
    for i, item in enumerate(source):
        if isinstance(item, LayerCost):
            out.append(item)
            continue
        try:
            out.append(LayerCost(**item))
        except TypeError as error:
            raise ValueError(f"layer cost {i} is {item!r}; give each layer "
                             '{"forward": s, "forward_grad": s, "backward": s, "reconstruct": s or null}') from error
    return out


def save_costs(costs: Sequence[LayerCost], path: str) -> None:
    """Write ``costs`` as JSON through a temporary file and a rename: other ranks read this file to cut
    their stages, so they must find it whole or not at all."""
    write_text_atomic(path, json.dumps([asdict(c) for c in costs], indent=1))

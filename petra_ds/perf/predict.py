"""Steady-state time per micro-batch of each training variant, and how far it is from the throughput a
benchmark measured: the numbers the simulator exists to give."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping, Sequence

from .costs import Costs
from .programs import micro_batch_seconds, simulate_schedule
from .torch_programs import TORCH_VARIANTS, UnsupportedMicroBatches

__all__ = ["VARIANTS", "predict", "predict_host_bound", "report_costs", "seconds_per_micro_batch", "validate"]

#: what the simulator predicts; ``single`` is one process running every stage
VARIANTS = ("single", "naive_mp", "naive_mp_ckpt", "naive_mp_rev", "gpipe", "gpipe_ckpt", "1f1b", "1f1b_ckpt",
            "1f1b_rev", "petra") + TORCH_VARIANTS


def seconds_per_micro_batch(variant: str, costs: Costs, micro_batches: int, *, stages_per_rank: int = 1,
                            reversible: Sequence[bool] | None = None) -> float:
    """Steady-state seconds per micro-batch of ``variant`` (see ``VARIANTS``) with k = ``micro_batches``;
    :class:`UnsupportedMicroBatches` where torch's schedule refuses k.

    Pipelines flush every ``train_batch``: the time between the ends of consecutive batches / k. PETRA
    never flushes: its pace once the first micro-batch has gone all the way back, taken from the slowest
    rank over whole windows. (After the fill the later stages run ahead of the earlier ones by up to a
    clock per stage, which they only use up slowly when stages are nearly balanced; the slowest rank is
    already at the steady pace while the others still run faster.)
    """
    k = micro_batches
    if variant == "single":
        return sum(s.forward_grad + s.backward + s.step / k for s in costs.stages)
    J = costs.stage_count
    if variant == "petra":
        warm = math.ceil((2 * J - 1) / k) + 1
        measured = max(4, math.ceil(4 * J / k))
        sim = simulate_schedule("petra", costs, k, warm + measured, stages_per_rank=stages_per_rank,
                                reversible=reversible)
        return max(ends[-1] - ends[warm - 1] for ends in sim.rank_ends.values()) / (measured * k)
    per_batch = 1 if variant.startswith("naive_mp") else k
    sim = simulate_schedule(variant, costs, per_batch, 3, reversible=reversible)
    return (sim.batch_ends[2] - sim.batch_ends[0]) / (2 * per_batch)


def predict(costs: Costs, micro_batches: int, variants: Sequence[str] = VARIANTS, *,
            reversible: Sequence[bool] | None = None) -> dict[str, float]:
    """Seconds per micro-batch of each variant; torch's schedules that refuse k on J ranks are left out."""
    out = {}
    for v in variants:
        try:
            out[v] = seconds_per_micro_batch(v, costs, micro_batches, reversible=reversible)
        except UnsupportedMicroBatches:
            continue
    return out


def predict_host_bound(costs: Costs, micro_batches: int, host_s: Mapping[str, float | Sequence[float]], *,
                       reversible: Sequence[bool] | None = None) -> dict[str, float]:
    """Seconds per micro-batch of each variant of ``host_s`` on J ranks whose host needs ``host_s[variant]``
    (one value, or one per stage) per stage and micro-batch (PETRA: per stage-clock) to issue what the device
    runs asynchronously, with no host synchronisation inside a ``train_batch`` (:meth:`Costs.host_bound`); 0
    gives the device-only pace. Torch's schedules that refuse k on J ranks are left out."""
    out = {}
    for v, host in host_s.items():
        bound = costs.host_bound(host, lambda c, j, J, v=v: micro_batch_seconds(v, c, j, J))
        try:
            out[v] = seconds_per_micro_batch(v, bound, micro_batches, reversible=reversible)
        except UnsupportedMicroBatches:
            continue
    return out


def report_costs(report: Mapping[str, Any], costs: Costs | None = None) -> Costs:
    """A throughput report's ``"costs"`` (or ``costs``, e.g. those of another run of the same model and
    partition) as its DeepSpeed pipeline ran: ``"ds_streams": "stacked"`` says DeepSpeed got each stage's
    pair of streams as one tensor, so its backward was one call and ``backward_split`` does not apply."""
    if costs is None:
        if "costs" not in report:
            raise ValueError("this throughput report holds no stage costs (it ran with --no-costs): pass costs "
                             "measured on the same model and cut (--costs-from), or rerun the benchmark without "
                             "--no-costs")
        costs = Costs.from_dict(report["costs"])
    if report.get("ds_streams") == "stacked":
        costs = Costs(tuple(replace(s, backward_split=None) for s in costs.stages), costs.message_s)
    return costs


def validate(report: Mapping[str, Any], tolerance: float = 0.15, costs: Costs | None = None) -> dict[str, Any]:
    """Predicted vs measured samples/s of every variant of a throughput report.

    The report holds ``"costs"`` (or pass ``costs``; see :func:`report_costs`), ``"variants": {name:
    {"samples_per_s"}}``, ``"micro_batch_size"``, ``"micro_batches"`` (k) and ``"stages"`` (J). Variants
    this module does not model, or does not run at that k, are listed under ``"skipped"``."""
    costs = report_costs(report, costs)
    J, k, size = int(report["stages"]), int(report["micro_batches"]), int(report["micro_batch_size"])
    if costs.stage_count != J:
        raise ValueError(f"the report has {J} stages but costs for {costs.stage_count}")
    rows: dict[str, dict[str, float]] = {}
    skipped = []
    for name, measured in report["variants"].items():
        if name not in VARIANTS or not measured.get("samples_per_s"):
            skipped.append(name)
            continue
        try:
            seconds = seconds_per_micro_batch(name, costs, k)
        except UnsupportedMicroBatches:
            skipped.append(name)
            continue
        predicted = size / seconds
        got = float(measured["samples_per_s"])
        rows[name] = {"measured_samples_per_s": got, "predicted_samples_per_s": predicted,
                      "predicted_ms_per_micro_batch": 1e3 * seconds, "measured_ms_per_micro_batch": 1e3 * size / got,
                      "relative_error": (predicted - got) / got}
    worst = max((abs(r["relative_error"]) for r in rows.values()), default=0.0)
    return {"stages": J, "micro_batches": k, "micro_batch_size": size, "tolerance": tolerance,
            "ds_streams": report.get("ds_streams"), "costs": costs.to_dict(), "variants": rows, "skipped": skipped,
            "max_abs_relative_error": worst, "within_tolerance": worst <= tolerance}

"""What a run really does, said once at start-up: the method, the layout, the partition, every stage's
optimizer and learning-rate schedule, gradient clipping with where its value came from, PETRA's delay
compensation and where each stage's input FIFO waits (on the device, or offloaded to host memory). DeepSpeed
fills in what a config leaves out (0.19 clips gradients at norm 1.0 unless ``"gradient_clipping"`` says
otherwise), so the values are read from the engine, not from the config."""

from __future__ import annotations

import dataclasses
from typing import Any

import deepspeed
from deepspeed import comm as dist
from deepspeed.runtime.engine import DeepSpeedEngine

from ..pipeline.module import petra_parts
from ..schedule import delay

#: the optimizer hyper-parameters worth a line, where a param group has them
GROUP_KEYS = ("lr", "betas", "momentum", "nesterov", "weight_decay", "use_muon")


def _groups(optimizer: Any) -> list[dict]:
    groups = getattr(optimizer, "param_groups", None) or []
    return [{**{k: g[k] for k in GROUP_KEYS if k in g}, "tensors": len(g["params"])} for g in groups]


def _stage(stage: int, layers: list[int], optimizer: Any, scheduler: Any, fifo: str | None = None) -> dict:
    return {"stage": stage, "layers": layers,
            "optimizer": None if optimizer is None else type(optimizer).__name__, "param_groups": _groups(optimizer),
            "lr_schedule": None if scheduler is None else type(scheduler).__name__, "input_fifo": fifo}


def _fifo(stage: Any) -> str | None:
    """Where a PETRA stage's input FIFO waits: "host" (offloaded; stage 0's micro-batches too), "device", or None
    (it keeps none, or only stage 0's micro-batches on the device)."""
    if not (stage.keeps_input or stage.offloads_inputs):
        return None
    return "host" if stage.offloads_inputs else "device"


def _local_stages(engine: DeepSpeedEngine, petra: bool) -> list[dict]:
    if petra:
        parts = petra_parts(engine.module)  # a plain PipelineModule's own partition when it is not ours
        return [_stage(j, parts[j:j + 2], opt, sched, _fifo(engine.stages[j])) for j, opt, sched in
                zip(engine.local_stage_ids, engine.stage_optimizers, engine.stage_schedulers)]
    parts = getattr(engine.module, "parts", None)
    stage = getattr(engine, "stage_id", 0)
    return [_stage(stage, [int(p) for p in parts[stage:stage + 2]] if parts is not None else [],
                   engine.optimizer, engine.lr_scheduler)]


def _plain(value: Any) -> Any:
    """A delay compensation (one method, or several combined) as JSON-ready dicts, one per method."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "parts"):
        return [_plain(v) for v in value.parts]
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _describe_compensation(methods: Any) -> str:
    """"weight_prediction + adaptive_momentum (beta1_max 0.95)": each method, with the parameters set to
    other than their defaults."""
    from ..runtime.compensation import DelayCompensation

    defaults = dataclasses.asdict(DelayCompensation())
    parts = []
    for m in methods if isinstance(methods, list) else [methods]:
        changed = ", ".join(f"{k} {v}" for k, v in m.items() if k != "method" and v != defaults.get(k))
        parts.append(m["method"] + (f" ({changed})" if changed else ""))
    return " + ".join(parts) or "none"


def run_settings(engine: DeepSpeedEngine, config: dict) -> dict:
    """The settings of ``engine`` built from ``config`` (the dict given to ``initialize``), every stage's
    included: a collective call (each rank describes its own stages)."""
    from ..runtime.engine import PetraEngine

    petra = isinstance(engine, PetraEngine)
    mine = _local_stages(engine, petra)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    stages = sorted({s["stage"]: s for rank in gathered for s in rank}.values(), key=lambda s: s["stage"])
    clip = float(engine.gradient_clipping())
    grid = getattr(engine, "grid", None)
    return {
        "method": "petra" if petra else "backprop",
        "engine": type(engine).__name__,
        "world_size": dist.get_world_size(),
        "pipeline_ranks": getattr(engine, "num_stages", 1),
        "data_parallel": grid.data_parallel_size if grid is not None else dist.get_world_size(),
        "stages": getattr(engine, "num_petra_stages", getattr(engine, "num_stages", 1)),
        "stages_per_rank": getattr(engine, "stages_per_rank", 1),
        "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
        "micro_batches_per_step": engine.gradient_accumulation_steps(),
        "precision": engine.precision.describe() if petra else
        ("bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"),
        "gradient_clipping": {
            "max_norm": clip,
            "from": "config" if "gradient_clipping" in config else f"DeepSpeed {deepspeed.__version__}'s default",
            "scope": "off" if clip <= 0 else ("each stage's own parameters" if petra else "all parameters (one norm)")},
        "lr_schedule_config": config.get("scheduler"),
        "delay_compensation": _plain(engine.petra_config.delay_compensation) if petra else None,
        "synchronous_steps": engine.petra_config.synchronous_steps if petra else None,
        "fifo_offload": engine.petra_config.fifo_offload if petra else None,
        "message_offload": engine.petra_config.message_offload if petra else None,
        "cuda_graphs": engine.petra_config.cuda_graphs if petra else None,
        "graphed_parts": sum(len(st.graphed) for st in engine.stages.values()) if petra else None,
        "device": engine.device.type,
        "per_stage": stages,
    }


def _describe_stage(s: dict) -> str:
    groups = "; ".join(", ".join(f"{k} {v}" for k, v in g.items() if k != "tensors") for g in s["param_groups"])
    schedule = s["lr_schedule"] or "constant lr"
    return f"{s['optimizer']} ({groups}), {schedule}"


def format_settings(settings: dict) -> str:
    """The settings as the lines rank 0 prints: stages with the same optimizer and schedule share a line."""
    s = settings
    lines = [f"method: {s['method']} ({s['engine']}); processes: {s['world_size']} = {s['pipeline_ranks']} pipeline "
             f"x {s['data_parallel']} data-parallel; stages: {s['stages']} ({s['stages_per_rank']} per rank); "
             f"{s['micro_batches_per_step']} micro-batches of {s['micro_batch_size']} per step"
             + ("" if s["precision"] == "fp32" else f"; {s['precision']}")]
    runs: list[tuple[list[int], str]] = []
    for stage in s["per_stage"]:
        text = _describe_stage(stage)
        if runs and runs[-1][1] == text:
            runs[-1][0].append(stage["stage"])
        else:
            runs.append(([stage["stage"]], text))
    for ids, text in runs:
        name = f"stage {ids[0]}" if len(ids) == 1 else f"stages {ids[0]}-{ids[-1]}"
        lines.append(f"  {name}: {text}")
    lines.append("  partition (first layer of each stage, then the end): "
                 + " ".join(str(st["layers"][0]) for st in s["per_stage"] if st["layers"])
                 + (f" {s['per_stage'][-1]['layers'][-1]}" if s["per_stage"] and s["per_stage"][-1]["layers"] else ""))
    clip = s["gradient_clipping"]
    if clip["max_norm"] > 0:
        lines.append(f"  gradient clipping: norm {clip['max_norm']:g} over {clip['scope']}, from {clip['from']}"
                     + ("" if clip["from"] == "config"
                        else ' (set "gradient_clipping": 0 in the config to turn it off)'))
    else:
        lines.append(f"  gradient clipping: off, from {clip['from']}")
    if s["method"] == "petra":
        lines.append(f"  delay compensation: {_describe_compensation(s['delay_compensation'])}")
        if s.get("synchronous_steps"):
            lines.append(f"  synchronous steps: the first {s['synchronous_steps']} train_batch calls drain (no delay, "
                         f"compensation waits; {delay(0, s['stages'])} more clocks each)")
        lines.append(f"  input FIFO: {_describe_fifos(s['per_stage'])}" + _auto_offload(s))
        if s.get("message_offload") == "cpu":
            lines.append("  messages between stages of one rank: wait in host memory (message_offload)")
        if s.get("cuda_graphs"):
            lines.append(f"  CUDA graphs{' (eager stand-ins)' if s['cuda_graphs'] == 'emulate' else ''}: "
                         f"{s['graphed_parts']} parts of this rank's stages replay graphs, captured at their first "
                         f"calls (cuda_graphs)")
    return "\n".join(lines)


def _auto_offload(s: dict) -> str:
    if s.get("fifo_offload") != "auto":
        return ""
    if s.get("device") == "cuda":
        return "; fifo_offload auto: each stage decides after its first forwards, and says so"
    return "; fifo_offload auto: nothing leaves (on a CPU the device is host memory)"


def _describe_fifos(stages: list[dict]) -> str:
    """"stage 2 offloads it to host memory; stage 5 keeps it on the device": per stage that keeps its inputs."""
    where = {"host": "offload{s} it to host memory", "device": "keep{s} it on the device"}
    parts = []
    for kind, text in where.items():
        ids = [str(st["stage"]) for st in stages if st.get("input_fifo") == kind]
        if ids:
            one = len(ids) == 1
            parts.append(("stage " if one else "stages ") + ", ".join(ids) + " " + text.format(s="s" if one else ""))
    return "; ".join(parts) or "none"

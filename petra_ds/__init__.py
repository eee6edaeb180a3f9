"""petra_ds: PETRA (Parallel End-to-end Training with Reversible Architectures) on DeepSpeed.

``initialize`` lives here, as ``deepspeed.initialize`` lives in ``deepspeed/__init__.py``: it is the one
place that sees every layer (ARCHITECTURE.md, "Layers"). Modules that moved between layers stay importable
under their former names (:mod:`petra_ds.moved`).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.utils import logger

from .diagnostics.gradient_quality import GradientQuality
from .diagnostics.settings import format_settings, run_settings
from .nn.check import NonFiniteError
from .pipeline.module import PetraPipelineModule, stages_per_rank_of, tag_muon_parameters
from .runtime.config import (PetraConfig, PetraConfigError, check_section_names, check_stages_per_rank,
                             jit_build_notice, split_config, uses_muon)
from .runtime.distributed import apply_group_timeout_to, ensure_single_process_env, init_distributed, is_rank0
from .runtime.engine import PetraEngine
from .runtime.layouts import built_contiguous
from .runtime.precision import bf16_device_notice, float32_while_built
from .schedule import first_stage_lateness

__version__ = "0.1.0"

__all__ = [
    "NonFiniteError",
    "PetraConfig",
    "PetraConfigError",
    "PetraEngine",
    "PetraPipelineModule",
    "ensure_single_process_env",
    "init_distributed",
    "initialize",
]


def _load(config: Any, args: Any) -> dict:
    if config is None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
    if config is None:
        raise PetraConfigError("no DeepSpeed config: pass config=... or --deepspeed_config")
    if isinstance(config, dict):
        return dict(config)
    with open(config) as f:
        return json.load(f)


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple:
    """Same arguments and returned tuple ``(engine, optimizer, dataloader, lr_scheduler)`` as
    ``deepspeed.initialize``. With a ``"petra"`` section the engine is a :class:`PetraEngine`."""
    raw = _load(config, args)
    check_section_names(raw)
    if optimizer is None and is_rank0():
        notice = jit_build_notice(raw, os.environ, torch.cuda.is_available())
        if notice:
            logger.warning(notice)
    apply_group_timeout_to(model)
    if getattr(args, "deepspeed_config", None):
        args = copy.copy(args)  # the config now travels as a dict; DeepSpeed refuses both
        args.deepspeed_config = None
    if "petra" not in raw:
        if getattr(model, "stages_per_rank", 1) != 1:
            raise PetraConfigError(
                f"the model was built with stages_per_rank={model.stages_per_rank} but the config has no "
                '"petra" section, so DeepSpeed would run its own 1F1B schedule; add "petra": '
                f'{{"stages_per_rank": {model.stages_per_rank}}} (or build a plain PipelineModule for 1F1B)')
        if not (optimizer is None and uses_muon(raw) and isinstance(model, PipelineModule)
                and not isinstance(model, DualPipeVModule) and not kwargs):
            with built_contiguous(model, keep_layout=False):  # its engine broadcasts each parameter as bytes
                built = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                             model_parameters=model_parameters, training_data=training_data,
                                             lr_scheduler=lr_scheduler, dist_init_required=dist_init_required,
                                             collate_fn=collate_fn, config=raw, **kwargs)
            announce(built[0], raw)
            return built
        # deepspeed.initialize would re-tag Muon's parameters by name; build its pipeline engine as it does
        tag_muon_parameters(model)
        with built_contiguous(model, keep_layout=False):
            engine = PipelineEngine(args=args, model=model, optimizer=None, model_parameters=model_parameters,
                                    training_data=training_data, lr_scheduler=lr_scheduler, mpu=model.mpu(),
                                    dist_init_required=dist_init_required, collate_fn=collate_fn, config=raw,
                                    config_class=DeepSpeedConfig(raw, model.mpu()))
        announce(engine, raw)
        return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
    petra, ds_config, precision = split_config(raw)
    if not isinstance(model, PipelineModule):
        if isinstance(getattr(model, "_orig_mod", None), PipelineModule):  # torch.compile(model)'s wrapper
            raise TypeError('PETRA needs the PipelineModule itself, not torch.compile(model): pass the module and set '
                            '"petra": {"compile": true}, which compiles each stage\'s layers in place')
        raise TypeError("PETRA needs a deepspeed.pipe.PipelineModule (or petra_ds.PetraPipelineModule); "
                        f"got {type(model).__name__}")
    check_stages_per_rank(petra, stages_per_rank_of(model))
    if optimizer is None and "optimizer" not in ds_config:
        raise PetraConfigError('PETRA needs an optimizer: add an "optimizer" section or pass optimizer=...')
    mpu = model.mpu()
    config_class = DeepSpeedConfig(ds_config, mpu)
    if uses_muon(ds_config):
        tag_muon_parameters(model)
    # PETRA's bf16 and fp16 keep fp32 parameters; DeepSpeed's engine broadcasts each parameter as bytes while built
    with float32_while_built(model, precision), built_contiguous(model, keep_layout=True):
        engine = PetraEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                             training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                             dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                             config_class=config_class, petra_config=petra, precision=precision)
    late = first_stage_lateness(engine.num_petra_stages, engine.micro_batches)
    if late and engine.global_rank == 0:
        logger.warning(late)
    if precision.name == "bf16" and engine.device.type == "cuda" and engine.global_rank == 0:
        notice = bf16_device_notice(torch.cuda.get_device_capability(engine.device),
                                    torch.cuda.get_device_name(engine.device))
        if notice:
            logger.warning(notice)
    if petra.gradient_quality_every > 0:
        engine.gradient_quality = engine.observe(GradientQuality(engine, petra.gradient_quality_every))
    announce(engine, raw)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def announce(engine: DeepSpeedEngine, config: dict) -> None:
    """Record what the run does as ``engine.run_settings`` (:func:`petra_ds.diagnostics.settings.run_settings`;
    the examples put it in summary.json) and print it on rank 0."""
    engine.run_settings = run_settings(engine, config)
    if is_rank0():
        print(format_settings(engine.run_settings), flush=True)

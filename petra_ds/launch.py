"""``petra_ds.initialize``: ``deepspeed.initialize`` with PETRA when the config has a ``"petra"`` section."""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import sys
from datetime import timedelta
from typing import Any

import deepspeed
import torch
from deepspeed.constants import default_pg_timeout
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.utils import logger

from .config import PetraConfigError, check_section_names, split_config, uses_muon
from .module import stages_per_rank_of, tag_muon_parameters
from .schedule import first_stage_lateness
from .settings import format_settings, run_settings


def is_rank0() -> bool:
    """Whether this process speaks for the run: global rank 0, or the only process before
    torch.distributed starts (never ``LOCAL_RANK``, which is 0 once per node)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_single_process_env() -> None:
    """Let a plain ``python script.py`` (one process hosting every stage) start torch.distributed."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


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
    from .engine import PetraEngine

    raw = _load(config, args)
    check_section_names(raw)
    if _group_timeout is not None and isinstance(model, PipelineModule):
        apply_group_timeout(model.mpu(), _group_timeout)
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
            built = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                         model_parameters=model_parameters, training_data=training_data,
                                         lr_scheduler=lr_scheduler, dist_init_required=dist_init_required,
                                         collate_fn=collate_fn, config=raw, **kwargs)
            announce(built[0], raw)
            return built
        # deepspeed.initialize would re-tag Muon's parameters by name; build its pipeline engine as it does
        tag_muon_parameters(model)
        engine = PipelineEngine(args=args, model=model, optimizer=None, model_parameters=model_parameters,
                                training_data=training_data, lr_scheduler=lr_scheduler, mpu=model.mpu(),
                                dist_init_required=dist_init_required, collate_fn=collate_fn, config=raw,
                                config_class=DeepSpeedConfig(raw, model.mpu()))
        announce(engine, raw)
        return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
    petra, ds_config, bf16 = split_config(raw)
    if not isinstance(model, PipelineModule):
        raise TypeError("PETRA needs a deepspeed.pipe.PipelineModule (or petra_ds.PetraPipelineModule); "
                        f"got {type(model).__name__}")
    if stages_per_rank_of(model) != petra.stages_per_rank:
        raise PetraConfigError(
            f'"petra.stages_per_rank" is {petra.stages_per_rank} but the model was built with '
            f"stages_per_rank={stages_per_rank_of(model)}; build it with "
            "petra_ds.PetraPipelineModule(..., stages_per_rank=...) matching the config")
    if optimizer is None and "optimizer" not in ds_config:
        raise PetraConfigError('PETRA needs an optimizer: add an "optimizer" section or pass optimizer=...')
    mpu = model.mpu()
    config_class = DeepSpeedConfig(ds_config, mpu)
    if uses_muon(ds_config):
        tag_muon_parameters(model)
    engine = PetraEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                         training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                         dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                         config_class=config_class, petra_config=petra, bf16=bf16)
    late = first_stage_lateness(engine.num_petra_stages, engine.micro_batches)
    if late and engine.global_rank == 0:
        logger.warning(late)
    if petra.gradient_quality_every > 0:
        from .analysis.gradient_quality import GradientQuality

        engine.gradient_quality = engine.observe(GradientQuality(engine, petra.gradient_quality_every))
    announce(engine, raw)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def announce(engine: Any, config: dict) -> None:
    """Record what the run does as ``engine.run_settings`` (:func:`petra_ds.settings.run_settings`; the
    examples put it in summary.json) and print it on rank 0."""
    engine.run_settings = run_settings(engine, config)
    if is_rank0():
        print(format_settings(engine.run_settings), flush=True)


#: the timeout given to :func:`init_distributed`, for the pipeline's process groups
_group_timeout: timedelta | None = None


def shm_comm_build_note() -> str | None:
    """What to tell the user before ``deepspeed.init_distributed`` JIT-compiles DeepSpeed's CPU communication
    op (``deepspeed_shm_comm``: the first init on a CPU machine builds it, 1-2 minutes without output, and
    needs a C++ compiler, or every launch fails with "Error building extension 'deepspeed_shm_comm'"); None
    when nothing will be built: a GPU, oneCCL, DeepSpeed already initialized, the op shipped prebuilt or
    already in torch's extension directory. DeepSpeed 0.19 has no switch to skip the op (only its CPU
    inference all-reduce uses it, PETRA does not)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    accelerator = get_accelerator()
    if (deepspeed.comm.is_initialized() or accelerator.device_name() != "cpu"
            or accelerator.communication_backend_name() == "ccl"):
        return None
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    if builder is None or installed_ops.get(builder.NAME, False) or not builder.is_compatible():
        return None
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:  # torch.utils.cpp_extension's layout: <build root>/py311_cu130/<name>/<name>.so
        if torch.version.hip:
            build = "rocm" + torch.version.hip
        elif torch.version.cuda:
            build = "cu" + torch.version.cuda
        else:
            build = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{build.replace('.', '')}")
    if os.path.exists(os.path.join(root, builder.NAME, builder.NAME + ".so")):
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return ("DeepSpeed's CPU communication op needs a C++ compiler and none was found: install g++ "
                "(apt-get install g++), or the start fails with \"Error building extension 'deepspeed_shm_comm'\"")
    return "building DeepSpeed's CPU communication op (needs g++, about a minute the first time)"


def init_distributed(dist_backend: str | None = None, timeout: timedelta | None = None, **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` that also works in a plain ``python`` process (one rank).

    ``timeout`` (default: DeepSpeed's, ``$DEEPSPEED_TIMEOUT`` minutes) bounds how long a rank waits on
    a peer that stopped answering without dying (a dead process is noticed within seconds);
    :func:`initialize` gives the pipeline's own process groups the same bound. On a CPU machine rank 0
    first says when DeepSpeed is about to compile its communication op (:func:`shm_comm_build_note`)."""
    global _group_timeout
    ensure_single_process_env()
    check_elastic_store(os.environ)
    timeout = timeout or default_pg_timeout
    note = shm_comm_build_note() if os.environ.get("RANK", "0") == "0" else None
    if note:
        print(note, flush=True)
    deepspeed.init_distributed(dist_backend=dist_backend, timeout=timeout, **kwargs)
    _group_timeout = timeout


#: what makes torchrun's restarted workers safe: a fresh store per attempt (pytorch/pytorch#135712)
SEPARATE_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def check_elastic_store(env: Any) -> None:
    """torchrun (c10d rendezvous) lends its workers its own store, the same one for every restart: a
    restarted worker then reads the addresses the previous attempt's workers published and its process
    groups fail to connect or wait forever (pytorch/pytorch#135712). Warn when restarts are allowed on
    that store; stop a restarted worker on it with the fix instead of letting it hang."""
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not shared or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return
    fix = (f"launch torchrun with {SEPARATE_STORE} in its environment (each attempt then gets a store of its "
           "own)")
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        raise RuntimeError(f"this worker was restarted by torchrun on the store of its first attempt, where its "
                           f"process groups would meet the previous workers' addresses and hang: {fix}")
    if env.get("RANK", "0") == "0":
        logger.warning(f"torchrun may restart these workers (--max-restarts), but they share its rendezvous store; "
                       f"a restarted worker could not connect: {fix}")


def apply_group_timeout(grid: Any, timeout: timedelta) -> None:
    """Give a pipeline grid's pipe, data- and model-parallel groups ``timeout``: torch creates them
    with its own default (30 minutes for gloo) whatever the world group was given."""
    set_timeout = getattr(torch.distributed, "set_timeout", None) or getattr(
        torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    getters = ("get_pipe_parallel_group", "get_data_parallel_group", "get_model_parallel_group",
               "get_slice_parallel_group")
    groups = {id(g): g for g in (getattr(grid, name)() for name in getters) if g is not None}
    for group in groups.values():
        if torch.distributed.get_rank(group) >= 0:  # -1: this rank is not in the group
            set_timeout(timeout, group)

"""Atomic checkpoint directories in DeepSpeed's pipeline layout, plus PETRA's in-flight state.

Layer weights go to ``<dir>/<tag>/layer_XX-model_states.pt`` exactly as DeepSpeed's ``PipelineModule``
writes them (so a plain ``PipelineModule.load_state_dir`` reads them); each rank adds
``petra_state-pipe_XX-data_YY.pt`` with what is in flight there: clock, accumulated gradients, input
FIFOs, stashed parameters, stage 0's raw micro-batches, messages received for the next clock,
optimizer and scheduler states.

Everything is written into ``<dir>/.<tag>.partial`` first; once every rank has written, rank 0 moves
the previous ``<tag>`` aside, renames the partial directory into place and rewrites ``latest``
through a temporary file. A process killed at any point leaves the previous checkpoint and ``latest``
loadable (``resolve`` falls back to the moved-aside copy in the one window where it is needed).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from ..util.files import atomic_save, write_text_atomic

if TYPE_CHECKING:
    from .engine import PetraEngine

LATEST = "latest"
#: ``petra`` keys that do not change training: a checkpoint resumes under other values
DIAGNOSTIC_KEYS = ("gradient_quality_every", "check_reversible", "reconstruct_overlap", "compile", "fifo_offload")


def partial_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.partial")


def state_file(ckpt_dir: str, pipe: int, data: int) -> str:
    return os.path.join(ckpt_dir, f"petra_state-pipe_{pipe:02d}-data_{data:02d}.pt")


def prepare(save_dir: str, tag: str) -> str:
    """(rank 0) A fresh partial directory for ``tag``."""
    path = partial_dir(save_dir, tag)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def commit(save_dir: str, tag: str, save_latest: bool) -> str:
    """(rank 0, after every rank wrote) Put the partial directory in place of ``tag``."""
    final = os.path.join(save_dir, tag)
    aside = os.path.join(save_dir, f".{tag}.old")
    if os.path.exists(aside) and not os.path.exists(final):
        os.replace(aside, final)  # an earlier crash left this tag only aside: it is the live copy
    if os.path.exists(aside):
        shutil.rmtree(aside)
    if os.path.exists(final):
        os.replace(final, aside)
    os.replace(partial_dir(save_dir, tag), final)
    if save_latest:
        write_text_atomic(os.path.join(save_dir, LATEST), tag)
    if os.path.exists(aside):
        shutil.rmtree(aside)
    return final


def resolve(load_dir: str, tag: str | None) -> tuple[str, str]:
    """(tag, directory) to load; ``tag=None`` reads ``latest``."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.exists(latest):
            raise FileNotFoundError(f"no '{LATEST}' file in {load_dir}: pass tag=... or save with save_latest=True")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, str(tag))
    if not os.path.isdir(path):
        aside = os.path.join(load_dir, f".{tag}.old")
        if os.path.isdir(aside):
            return str(tag), aside
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return str(tag), path


# --- a PetraEngine's checkpoint (the engine's save_checkpoint / load_checkpoint) ---


def save_engine(engine: PetraEngine, save_dir: str, tag: str, client_state: dict | None, save_latest: bool,
                exclude_frozen_parameters: bool) -> str:
    """Every rank: its layer files in DeepSpeed's layout and its PETRA state, then rank 0 commits."""
    if engine.mid_clock:
        raise RuntimeError("save_checkpoint() must be called between train_batch() calls")
    if engine.global_rank == 0:
        prepare(save_dir, tag)
    engine.transport.barrier("save_checkpoint: the directory is prepared")
    path = partial_dir(save_dir, tag)
    engine.module.save_state_dict(path, checkpoint_engine=engine.checkpoint_engine,
                                  exclude_frozen_params=exclude_frozen_parameters)
    atomic_save(engine_state(engine, client_state), state_file(path, engine.stage_id, engine.grid.data_parallel_id))
    engine.transport.barrier("save_checkpoint: every rank wrote its files")
    final = os.path.join(save_dir, tag)
    if engine.global_rank == 0:
        final = commit(save_dir, tag, save_latest)
    engine.transport.barrier("save_checkpoint: committed")
    engine.transport.save_trace()
    return final


def layout_signature(engine: PetraEngine) -> dict:
    """What a checkpoint must match to be resumed: the parallel layout, k, the training-relevant config."""
    return {"pipe": engine.pipeline_ranks, "data": engine.grid.data_parallel_size,
            "stages_per_rank": engine.stages_per_rank, "k": engine.micro_batches,
            "petra": {k: v for k, v in asdict(engine.petra_config).items() if k not in DIAGNOSTIC_KEYS}}


def engine_state(engine: PetraEngine, client_state: dict | None) -> dict:
    """A rank's in-flight PETRA state between two ``train_batch`` calls."""
    return {"format": 1, "layout": layout_signature(engine), **engine.petra_state(), "client_state": client_state or {}}


def load_engine(engine: PetraEngine, load_dir: str, tag: str | None, strict: bool, optimizer_states: bool,
                scheduler_states: bool, module_only: bool) -> tuple[str, dict]:
    """Load what :func:`save_engine` wrote; training continues exactly where it stopped."""
    tag, path = resolve(load_dir, tag)
    engine.module.load_state_dir(load_dir=path, checkpoint_engine=engine.checkpoint_engine, strict=strict)
    if module_only:
        return path, {}
    state = torch.load(state_file(path, engine.stage_id, engine.grid.data_parallel_id), map_location=engine.device,
                       weights_only=False)
    if state["layout"] != layout_signature(engine):
        raise ValueError(f"checkpoint {path} was written with {state['layout']}, this run has "
                         f"{layout_signature(engine)}; resume with the same layout and petra config")
    engine.load_petra_state(state, optimizer_states, scheduler_states)
    return path, state["client_state"]

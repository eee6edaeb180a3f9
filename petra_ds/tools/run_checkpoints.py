"""The examples' checkpoints: save with the script's state, keep the newest few, and resume from the
newest one that is whole, so that a job restarted by a scheduler (torchrun --max-restarts) continues by
itself.

A checkpoint is ``<output-dir>/checkpoints/global_step<N>`` in DeepSpeed's layout, for PETRA's engine and
for DeepSpeed's 1F1B alike. Before loading one, the ranks check it together: every rank looks for the
files its own load will open (its layers', and PETRA's state of the stages it hosts), and checks the checksums of
its share of all the files (torch writes zip archives); then the ranks agree, so that all of them load
the same checkpoint or all of them go back to the one before.
"""

from __future__ import annotations

import os
import re
import shutil
import zipfile
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.runtime.engine import DeepSpeedEngine

from ..runtime.checkpoint import LATEST, state_files, written_per_rank
from ..runtime.distributed import is_rank0

TAG = re.compile(r"global_step(\d+)$")


def checkpoint_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def tags(ckpt_dir: str) -> list[str]:
    """The checkpoints in ``ckpt_dir``, newest first: the one ``latest`` names, then the others by step."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = sorted((int(m.group(1)), name) for name in os.listdir(ckpt_dir)
                   if (m := TAG.match(name)) and os.path.isdir(os.path.join(ckpt_dir, name)))
    ordered = [name for _, name in reversed(found)]
    latest = os.path.join(ckpt_dir, LATEST)
    if os.path.exists(latest):
        with open(latest) as f:
            head = f.read().strip()
        if head in ordered:
            ordered.remove(head)
            ordered.insert(0, head)
    return ordered


def save(engine: DeepSpeedEngine, output_dir: str, state: dict, keep_last: int = 0) -> None:
    """Checkpoint the engine (PETRA's or DeepSpeed's 1F1B) with the script's ``state``, this rank's torch
    random state and the module's forward counter (DeepSpeed's 1F1B draws dropout masks from the global
    stream, reseeded from that counter with ``seed_layers``, and saves neither; PETRA keys its masks by
    micro-batch); then rank 0 removes all but the newest ``keep_last`` checkpoints (0: keep all)."""
    ckpt_dir = checkpoint_dir(output_dir)
    engine.save_checkpoint(ckpt_dir, client_state={"example": {
        **state, "rng": torch.get_rng_state(), "micro_offset": getattr(engine.module, "micro_offset", None)}})
    if keep_last and is_rank0():
        for old in tags(ckpt_dir)[keep_last:]:
            shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)


def finish(engine: DeepSpeedEngine) -> None:
    """Every rank, before the run ends: wait for a checkpoint PETRA's engine writes in the background
    (``--async-save``) to be on disk and committed."""
    from ..runtime.engine import PetraEngine

    if isinstance(engine, PetraEngine):
        engine.wait_for_checkpoint()


def problems(engine: DeepSpeedEngine, path: str) -> list[str]:
    """What is wrong with the checkpoint in ``path``, as this rank sees it: a file its load needs that is
    missing, or a file of its share (every world-size-th, from its rank) that is truncated or corrupted."""
    found = []
    module = engine.module
    for idx, layer in enumerate(module.forward_funcs):
        if hasattr(layer, "load_state_dict") and not module.ckpt_layer_path_list(path, idx):
            found.append(f"{module.ckpt_layer_path(path, idx)} is missing")
    from ..runtime.engine import PetraEngine

    if isinstance(engine, PetraEngine):
        found += [f"{own} is missing" for own in state_files(engine, path, written_per_rank(path))
                  if not os.path.exists(own)]
    files = sorted(name for name in os.listdir(path) if name.endswith(".pt"))
    for name in files[dist.get_rank()::dist.get_world_size()]:
        try:
            with zipfile.ZipFile(os.path.join(path, name)) as archive:
                bad = archive.testzip()
            if bad is not None:
                found.append(f"{os.path.join(path, name)} is corrupted (its entry {bad} fails its checksum)")
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            found.append(f"{os.path.join(path, name)} is truncated or corrupted ({error})")
    return found


def _agreed(mine: list[str]) -> list[str]:
    """Every rank's problems, on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [p for rank in gathered for p in rank]


def _load(engine: DeepSpeedEngine, ckpt_dir: str, tag: str) -> dict:
    """Load ``tag`` on every rank; its client state, or :class:`CheckpointDamaged` on every rank when any
    rank's load failed (the next checkpoint's load then overwrites whatever this one changed)."""
    try:
        _, client_state = engine.load_checkpoint(ckpt_dir, tag=tag)
        mine = []
    except Exception as error:  # a failure the checks did not foresee: name it and let the ranks agree
        client_state = None
        mine = [f"it does not load on rank {dist.get_rank()}: {type(error).__name__}: {error}"]
    found = _agreed(mine)
    if found:
        raise CheckpointDamaged(os.path.join(ckpt_dir, tag), found)
    return client_state


class CheckpointDamaged(RuntimeError):
    """A checkpoint that cannot be resumed, with what every rank found wrong with it."""

    def __init__(self, path: str, found: list[str]) -> None:
        super().__init__(f"checkpoint {path} cannot be resumed: " + "; ".join(found))
        self.path = path


def resume(engine: DeepSpeedEngine, output_dir: str, fall_back: bool = True) -> dict | None:
    """Load the newest whole checkpoint in ``<output_dir>/checkpoints`` into the engine (step count,
    optimizer and LR scheduler states, PETRA's micro-batches in flight) and return the state :func:`save`
    stored with it; None, and nothing loaded, when there is no checkpoint. A damaged newest checkpoint is
    named with what is wrong; with ``fall_back`` the run continues from the one before (--resume auto),
    without it the run stops and names the newest whole one (--resume)."""
    ckpt_dir = checkpoint_dir(output_dir)
    candidates = tags(ckpt_dir)
    if not candidates:
        if is_rank0():
            print(f"--resume auto: no checkpoint in {ckpt_dir}; starting fresh", flush=True)
        return None
    damaged: list[CheckpointDamaged] = []
    for tag in candidates:
        path = os.path.join(ckpt_dir, tag)
        try:
            found = _agreed(problems(engine, path))
            if found:
                raise CheckpointDamaged(path, found)
            if damaged and not fall_back:
                raise SystemExit(f"--resume: {damaged[0]}. The newest whole checkpoint is {path}: continue from "
                                 "it with --resume auto, which falls back to it" if is_rank0() else 2)
            client_state = _load(engine, ckpt_dir, tag)
            break
        except CheckpointDamaged as error:
            damaged.append(error)
            if is_rank0():
                print(f"warning: {error}", flush=True)
    else:
        raise SystemExit(f"--resume: no checkpoint in {ckpt_dir} can be resumed (see the warnings above); remove "
                         "the damaged ones to start fresh" if is_rank0() else 2)
    if is_rank0():
        print(f"resumed from {os.path.join(ckpt_dir, tag)} (step {engine.global_steps})"
              + (f", the newer {', '.join(e.path for e in damaged)} being damaged" if damaged else ""), flush=True)
    state = dict(client_state["example"])
    torch.set_rng_state(state.pop("rng").cpu())
    micro_offset = state.pop("micro_offset")
    if micro_offset is not None:
        engine.module.micro_offset = micro_offset
    return state

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

import torch

LATEST = "latest"


def partial_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.partial")


def state_file(ckpt_dir: str, pipe: int, data: int) -> str:
    return os.path.join(ckpt_dir, f"petra_state-pipe_{pipe:02d}-data_{data:02d}.pt")


def atomic_save(obj, path: str) -> None:
    """torch.save through a temporary file and a rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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

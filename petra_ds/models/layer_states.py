"""A pipeline's weights, layer by layer: loading a layer's state, cutting a whole model's state into layers,
and reading DeepSpeed's per-layer checkpoint files."""

from __future__ import annotations

import glob
import os
from typing import Sequence

import torch
from torch import Tensor, nn

State = dict[str, Tensor]


def load_into(module: nn.Module, state: State | None, what: str) -> None:
    """``module.load_state_dict(state)`` that names what did not match; None loads nothing."""
    if state is None:
        return
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{what}: weights do not match the config (missing {missing}, unexpected {unexpected})")


def split_by_prefix(state: State, layers: Sequence[dict[str, str]]) -> list[State]:
    """One state per layer: ``layers[i]`` maps a whole model's name prefix to layer i's own prefix."""
    return [{own + name[len(whole):]: value for name, value in state.items()
             for whole, own in prefixes.items() if name.startswith(whole)}
            for prefixes in layers]


def load_layer_files(checkpoint_dir: str, num_layers: int, tied_head: bool = False) -> list[State]:
    """The per-layer state dicts of a DeepSpeed pipeline checkpoint (``layer_XX[-model_YY]-model_states.pt``).
    A tied head has no file of its own (its weight is the embedding's): it comes back empty."""
    states = []
    for i in range(num_layers):
        paths = sorted(glob.glob(os.path.join(checkpoint_dir, f"layer_{i:02d}-*model_states.pt")))
        if not paths and tied_head and i == num_layers - 1:
            states.append({})
            continue
        if not paths:
            raise FileNotFoundError(f"no layer file for layer {i} in {checkpoint_dir}: is it a pipeline checkpoint "
                                    "directory (save_dir/tag) of this model?")
        states.append(torch.load(paths[0], map_location="cpu", weights_only=True))
    return states

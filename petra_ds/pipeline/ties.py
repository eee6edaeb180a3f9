"""Weights tied across PETRA stages (``TiedLayerSpec``, e.g. GPT's embedding and head).

The owner (the first stage using a tie) steps the weights with the sum of every reader's gradient of the
same step; each reader keeps its own copy, sends its gradient at its own step and takes the owner's new
weights one clock after the owner stepped (see ``petra_ds.pipeline.module.Tie``). This module holds which tensors
each local stage sends and receives, and what it does with them at a step; the engine moves the messages.
"""

from __future__ import annotations

from typing import Callable

import torch
from deepspeed.runtime.pipe.module import PipelineModule
from torch import nn

from ..nn.casts import weights_written
from ..schedule import channels
from .module import Tie, reader_copies, stage_ties, tied_params


class TiedWeights:
    """The ties of ``module`` as seen by the stages ``local`` of one rank."""

    def __init__(self, module: PipelineModule, local: range) -> None:
        self.ties: list[Tie] = stage_ties(module)
        #: (stage, tie key) -> the tied tensors that stage steps (owner) or mirrors (reader)
        self.tensors: dict[tuple[int, str], list[nn.Parameter]] = {}
        #: id(a reader copy's parameter) -> id(the owner's parameter it mirrors), for a copy on the owner's rank
        self.copy_of: dict[int, int] = {}
        for tie in self.ties:
            if tie.owner in local:
                self.tensors[(tie.owner, tie.key)] = tied_params(module.tied_modules[tie.key], tie.attrs)
            for j, twin in reader_copies(module, tie, local).items():
                self.tensors[(j, tie.key)] = tied_params(twin, tie.attrs)
                base = module.tied_modules[tie.key]
                if twin is not base:
                    self.copy_of.update({id(c): id(b) for c, b in zip(twin.parameters(), base.parameters())})

    def __bool__(self) -> bool:
        return bool(self.ties)

    def specs(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """``(key, owner, readers)`` per tie, as ``PetraSchedule`` takes them."""
        return [(tie.key, tie.owner, tie.readers) for tie in self.ties]

    def reader_ids(self, stage: int) -> set[int]:
        """ids of the tied copies ``stage`` reads but does not step."""
        return {id(p) for tie in self.ties if stage in tie.readers for p in self.tensors[(stage, tie.key)]}

    def gradients(self, stage: int, step: int,
                  take: Callable[[channels.Key], tuple | None]) -> dict[channels.Key, tuple]:
        """At ``stage``'s step: a reader's gradient for the owner (returned, by message key); the owner adds
        every reader's gradient of the same step, ``take(key)`` from what it received (a reader's k-th
        backward comes first)."""
        out = {}
        for tie in self.ties:
            if stage in tie.readers:
                out[channels.tied_grad_key(tie.owner, tie.key, stage, step)] = tuple(
                    p.grad.detach().clone() for p in self.tensors[(stage, tie.key)])
            elif stage == tie.owner:
                for reader in tie.readers:
                    contribution = take(channels.tied_grad_key(stage, tie.key, reader, step))
                    if contribution is None:
                        raise RuntimeError(f"stage {stage} takes step {step} without stage {reader}'s gradient "
                                           f"of the tied weights {tie.key!r}")
                    for p, g in zip(self.tensors[(stage, tie.key)], contribution):
                        p.grad.add_(g)
        return out

    def weights(self, stage: int, step: int) -> dict[channels.Key, tuple]:
        """After the owner's step: its new weights, one message per reader (by message key)."""
        out = {}
        for tie in self.ties:
            if stage == tie.owner:
                weights = tuple(p.detach().clone() for p in self.tensors[(stage, tie.key)])
                for reader in tie.readers:
                    out[channels.tied_weight_key(reader, tie.key, step)] = weights
        return out

    @staticmethod
    def is_weights(key: channels.Key) -> bool:
        """Whether message ``key`` carries an owner's new tied weights (for :meth:`apply`)."""
        tie = channels.tie_of(key.kind)
        return tie is not None and tie[0] == channels.TIED_WEIGHT

    def apply(self, received: dict[channels.Key, tuple]) -> None:
        """Tied weights received this clock replace the readers' copies before the next clock."""
        with torch.no_grad():
            for key, weights in received.items():
                for p, w in zip(self.tensors[(key.stage, channels.tie_of(key.kind)[1])], weights):
                    p.copy_(w)
        if received:  # a commit without tied weights writes none: the casts made so far stay good
            weights_written()

    def reader_module(self, stage: int, tie: Tie, modules: list[nn.Module]) -> nn.Module:
        """The module among ``modules`` (a stage's) that holds ``stage``'s copy of ``tie``."""
        ids = {id(p) for p in self.tensors[(stage, tie.key)]}
        return next(m for m in modules if any(id(p) in ids for p in m.parameters()))

    def reader_state(self, stage: int, modules: list[nn.Module]) -> dict[str, dict]:
        """``stage``'s copies of tied weights by tie key (``modules``: the stage's); DeepSpeed's layer files hold
        only the owner's."""
        return {tie.key: self.reader_module(stage, tie, modules).state_dict() for tie in self.ties
                if stage in tie.readers}

    def load_reader_state(self, stage: int, modules: list[nn.Module], states: dict[str, dict]) -> None:
        for tie in self.ties:
            if stage in tie.readers:
                self.reader_module(stage, tie, modules).load_state_dict(states[tie.key])

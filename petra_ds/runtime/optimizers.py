"""One optimizer and one LR scheduler per PETRA stage.

Each stage steps at its own clock (after its own k-th backward), so a rank hosting several stages
cannot share one optimizer between them. The builders below split the user's parameter groups by
stage and build each stage's optimizer and scheduler the way DeepSpeed would (config, callable or
instance); :class:`StageOptimizers` and :class:`StageSchedulers` show a rank's set as one object to code
that expects ``engine.optimizer`` / ``engine.lr_scheduler``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from deepspeed.utils import logger
from torch import nn
from torch.optim import Optimizer

from .config import PetraConfigError


class StageOptimizers:
    """The optimizers of a rank's stages seen as one, for code that expects ``engine.optimizer``.

    Each stage steps its own optimizer at its own clock; ``step()`` here is not part of PETRA.
    """

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"stages": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for opt, s in zip(self.optimizers, state["stages"]):
            opt.load_state_dict(s)


class StageSchedulers:
    """The LR schedulers of a rank's stages seen as one."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def get_last_lr(self) -> list[float]:
        return [lr for s in self.schedulers for lr in s.get_last_lr()]

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self) -> dict:
        return {"stages": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        for s, sd in zip(self.schedulers, state["stages"]):
            s.load_state_dict(sd)


def param_groups(model_parameters: Any) -> list[dict]:
    """The user's ``model_parameters`` (parameters or group dicts) as group dicts with lists."""
    params = list(model_parameters)
    if params and isinstance(params[0], dict):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


def stage_optimizers(client: Any, model_parameters: Any, module: nn.Module, stage_params: dict[int, set[int]],
                     copy_of: dict[int, int], from_config: Callable[[list[dict]], Optimizer]) -> list[Optimizer | None]:
    """Per local stage (in order), its optimizer over its own share of every group (None: nothing to
    step). A reader's tied copy on the owner's rank (``copy_of``) joins the groups of what it copies."""
    groups = param_groups(model_parameters)
    if copy_of:
        by_id = {id(p): p for p in module.parameters()}
        for g in groups:
            members = {id(p) for p in g["params"]}
            g["params"] += [by_id[c] for c, b in copy_of.items() if b in members and c not in members and c in by_id]
    if isinstance(client, Optimizer) and len(stage_params) > 1:
        raise PetraConfigError(
            "an optimizer instance cannot serve several PETRA stages that step at different clocks; "
            "pass a callable `optimizer=lambda params: ...` or configure it in the config")
    optimizers: list[Optimizer | None] = []
    for ids in stage_params.values():
        groups_here = [dict(g, params=[p for p in g["params"] if id(p) in ids]) for g in groups]
        groups_here = [g for g in groups_here if g["params"]]
        if not groups_here:  # a stage without trainable parameters (e.g. a reshape) steps nothing
            optimizers.append(None)
        elif isinstance(client, Optimizer):
            optimizers.append(client)
        elif client is not None:
            optimizers.append(client(groups_here))
        else:
            optimizers.append(from_config(groups_here))
    return optimizers


def stage_schedulers(client: Any, optimizers: list[Optimizer | None],
                     from_config: Callable[[Optimizer], Any]) -> list[Any]:
    """Per stage optimizer, its LR scheduler (None where there is no optimizer or no scheduler)."""
    if client is not None and not callable(client) and len(optimizers) > 1:
        raise PetraConfigError(
            "an LR scheduler instance cannot serve several PETRA stages; pass a callable "
            "`lr_scheduler=lambda optimizer: ...` or configure it in the config")
    schedulers = []
    once = _OncePerEngine()
    logger.addFilter(once)
    try:
        for opt in optimizers:
            if opt is None:
                schedulers.append(None)
            elif client is None:
                schedulers.append(from_config(opt))
            elif callable(client) and not hasattr(client, "step"):
                schedulers.append(client(opt))
            else:
                schedulers.append(client)
    finally:
        logger.removeFilter(once)
    return schedulers


class _OncePerEngine(logging.Filter):
    """DeepSpeed's own schedulers warn as they are built (WarmupCosineLR: "Attempting to get learning rate
    from scheduler before it has started", from its constructor): a DeepSpeed engine, with one scheduler,
    says it once, and so does PETRA's, whose every stage builds one."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        new = message not in self.seen
        self.seen.add(message)
        return new


def single_or_combined(items: list[Any], many: Callable[[list[Any]], Any]) -> Any:
    """The single present item, or ``many`` of the present ones, or None if none."""
    present = [x for x in items if x is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else many(present)

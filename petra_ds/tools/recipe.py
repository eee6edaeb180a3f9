"""The paper's training recipe (section 4.1) as defaults for the examples.

SGD with Nesterov momentum 0.9; lr = 0.1 x (micro-batch x k x data-parallel replicas) / 256 (Goyal
et al.); 5 warm-up epochs linear from 0; step decay x0.1 at 50% and 75% of training on CIFAR-10
(epochs 150 and 225 of 300) and at 1/3, 2/3 and 8/9 on ImageNet32 / ImageNet (30, 60, 80 of 90);
weight decay 5e-4 (CIFAR-10, digits) or 1e-4 (ImageNet), none on batch-norm parameters and biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

MILESTONES = {"cifar10": (0.5, 0.75), "digits": (0.5, 0.75), "imagenet32": (1 / 3, 2 / 3, 8 / 9),
              "imagenet": (1 / 3, 2 / 3, 8 / 9)}
WEIGHT_DECAY = {"cifar10": 5e-4, "digits": 5e-4, "imagenet32": 1e-4, "imagenet": 1e-4}


@dataclass(frozen=True)
class Recipe:
    lr: float
    momentum: float
    weight_decay: float
    warmup_epochs: float
    milestones: tuple[int, ...]  # epochs at which the lr is multiplied by 0.1
    epochs: int

    def lr_factor(self, step: int, steps_per_epoch: int) -> float:
        """Multiplier of ``lr`` after ``step`` optimizer steps."""
        epoch = step / max(steps_per_epoch, 1)
        if epoch < self.warmup_epochs:
            return epoch / self.warmup_epochs
        return 0.1 ** sum(epoch >= m for m in self.milestones)


def paper_recipe(dataset: str, epochs: int, samples_per_step: int, warmup_epochs: float = 5.0) -> Recipe:
    """The recipe for ``dataset`` trained ``epochs`` epochs with ``samples_per_step`` per optimizer step."""
    fractions = MILESTONES[dataset]
    return Recipe(lr=0.1 * samples_per_step / 256, momentum=0.9, weight_decay=WEIGHT_DECAY[dataset],
                  warmup_epochs=min(warmup_epochs, epochs / 4), epochs=epochs,
                  milestones=tuple(round(f * epochs) for f in fractions))


def no_decay_groups(named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on weights of convolutions and linear layers only (not batch norm, not biases)."""
    decay, no_decay = [], []
    for _, p in named_parameters:
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def sgd_factory(recipe: Recipe) -> Callable:
    """``optimizer=`` callable for (petra_ds|deepspeed).initialize: SGD with Nesterov momentum."""
    return lambda groups: torch.optim.SGD(groups, lr=recipe.lr, momentum=recipe.momentum, nesterov=True)


def scheduler_factory(recipe: Recipe, steps_per_epoch: int) -> Callable:
    """``lr_scheduler=`` callable: each stage's scheduler follows its own optimizer steps."""
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: recipe.lr_factor(step, steps_per_epoch))

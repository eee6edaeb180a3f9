"""Where batch-norm running statistics are updated (paper section 4.1).

PETRA's default updates them during the backward recomputation / reconstruction only: the forward
normalises with batch statistics and leaves the running ones alone, and evaluation uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import Tensor, nn

BN_POLICIES = ("backward", "forward")


def batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The batch norms under ``module`` that keep running statistics."""
    return [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
    ]


def running_stat_tensors(norms: Sequence[nn.modules.batchnorm._BatchNorm]) -> list[Tensor]:
    """The running means and variances of ``norms`` (what data-parallel replicas average)."""
    return [t for m in norms for t in (m.running_mean, m.running_var) if t is not None]


def running_stats(module: nn.Module, update: bool):
    """Inside, batch norms in training mode update their running statistics only if ``update``.

    With ``update=False`` they still normalise with batch statistics (PyTorch's path for
    ``track_running_stats=False``); evaluation mode always reads the running statistics.
    """
    return norms_running_stats(batch_norms(module), update)


class norms_running_stats:
    """:func:`running_stats` for a list from :func:`batch_norms`, found once by a caller on a hot path. Only the norms
    whose flag differs are set, and set back: a module attribute set costs microseconds, and under the default policy
    the backward's scopes change none (the flag already says to update). A class, not a generator function: a stage
    enters one at every instruction. The flag is a plain attribute, set as one: ``nn.Module.__setattr__`` first looks
    for a parameter, buffer or submodule of its name (1.5 us against 0.2 us a set)."""

    __slots__ = ("_norms", "_update", "_changed")

    def __init__(self, norms: Sequence[nn.modules.batchnorm._BatchNorm], update: bool) -> None:
        self._norms, self._update = norms, update

    def __enter__(self) -> None:
        self._changed = [m for m in self._norms if m.track_running_stats != self._update]
        for m in self._changed:
            object.__setattr__(m, "track_running_stats", self._update)

    def __exit__(self, *exc: object) -> None:
        for m in self._changed:
            object.__setattr__(m, "track_running_stats", not self._update)


@dataclass(frozen=True)
class BatchNormPolicy:
    """Which of the two evaluations of a micro-batch updates the running statistics."""

    update_in: str = "backward"

    def __post_init__(self) -> None:
        if self.update_in not in BN_POLICIES:
            raise ValueError(
                f"bn_running_stats must be one of {BN_POLICIES}, got {self.update_in!r}"
            )

    def forward_scope(self, module: nn.Module):
        """Context for the forward of a micro-batch."""
        return running_stats(module, update=self.update_in == "forward")

    def backward_scope(self, module: nn.Module):
        """Context for the recomputation / reconstruction of a micro-batch."""
        return running_stats(module, update=self.update_in == "backward")

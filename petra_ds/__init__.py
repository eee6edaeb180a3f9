"""petra_ds: PETRA (Parallel End-to-end Training with Reversible Architectures) on DeepSpeed."""

from .config import PetraConfig, PetraConfigError
from .launch import ensure_single_process_env, init_distributed, initialize
from .module import PetraPipelineModule
from .nn.check import NonFiniteError

__version__ = "0.1.0"

__all__ = [
    "NonFiniteError",
    "PetraConfig",
    "PetraConfigError",
    "PetraPipelineModule",
    "ensure_single_process_env",
    "init_distributed",
    "initialize",
]


def __getattr__(name: str):
    if name == "PetraEngine":
        from .engine import PetraEngine

        return PetraEngine
    raise AttributeError(name)

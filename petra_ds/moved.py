"""Former module names, kept importable after the package was split into layers.

``python -m petra_ds.analysis.timeline``, ``import petra_ds.keys`` or a pickle that names
``petra_ds.keys.Key`` find the module that holds that code now: the same module object, so classes stay
identical. New code imports the new names; this table only grows when a documented path moves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import CodeType, ModuleType

#: former name -> where the module lives now
MOVED = {
    "petra_ds.analysis": "petra_ds.perf",
    "petra_ds.analysis.costs": "petra_ds.perf.costs",
    "petra_ds.analysis.measure": "petra_ds.perf.measure",
    "petra_ds.analysis.memory": "petra_ds.perf.memory",
    "petra_ds.analysis.predict": "petra_ds.perf.predict",
    "petra_ds.analysis.programs": "petra_ds.perf.programs",
    "petra_ds.analysis.simulator": "petra_ds.perf.simulator",
    "petra_ds.analysis.timeline": "petra_ds.perf.timeline",
    "petra_ds.analysis.torch_programs": "petra_ds.perf.torch_programs",
    "petra_ds.analysis.gradient_quality": "petra_ds.diagnostics.gradient_quality",
    "petra_ds.analysis.held": "petra_ds.diagnostics.held",
    "petra_ds.checkpoint": "petra_ds.runtime.checkpoint",
    "petra_ds.compensation": "petra_ds.runtime.compensation",
    "petra_ds.config": "petra_ds.runtime.config",
    "petra_ds.engine": "petra_ds.runtime.engine",
    "petra_ds.finite": "petra_ds.runtime.finite",
    "petra_ds.keys": "petra_ds.schedule.channels",
    "petra_ds.ledger": "petra_ds.runtime.memory",
    "petra_ds.messages": "petra_ds.runtime.messages",
    "petra_ds.module": "petra_ds.pipeline.module",
    "petra_ds.nccl_replay": "petra_ds.verify.nccl_replay",
    "petra_ds.observe": "petra_ds.runtime.observe",
    "petra_ds.optimizers": "petra_ds.runtime.optimizers",
    "petra_ds.partition": "petra_ds.pipeline.partition",
    "petra_ds.recipe": "petra_ds.tools.recipe",
    "petra_ds.replay": "petra_ds.verify.replay",
    "petra_ds.run_checkpoints": "petra_ds.tools.run_checkpoints",
    "petra_ds.run_partition": "petra_ds.tools.run_partition",
    "petra_ds.runs": "petra_ds.tools.runs",
    "petra_ds.settings": "petra_ds.diagnostics.settings",
    "petra_ds.shutdown": "petra_ds.runtime.shutdown",
    "petra_ds.spawn": "petra_ds.tools.spawn",
    "petra_ds.stage": "petra_ds.runtime.stage",
    "petra_ds.ties": "petra_ds.pipeline.ties",
    "petra_ds.toy": "petra_ds.tools.toy",
    "petra_ds.transport": "petra_ds.runtime.transport",
}


class _Former(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a former name and hands out the module that replaced it (and, for ``python -m``, its code)."""

    def find_spec(self, name: str, path=None, target=None):
        if name not in MOVED:
            return None
        now = importlib.util.find_spec(MOVED[name])
        spec = importlib.util.spec_from_loader(name, self, origin=now.origin,
                                               is_package=now.submodule_search_locations is not None)
        spec.has_location = True  # python -m gives the code its file as sys.argv[0] and __file__
        return spec

    def create_module(self, spec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported under its own name."""

    def get_code(self, name: str) -> CodeType | None:
        spec = importlib.util.find_spec(MOVED[name])
        return spec.loader.get_code(MOVED[name])


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``petra_ds/__init__`` calls it)."""
    if not any(isinstance(finder, _Former) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Former())  # before the path finder, which would load a second copy

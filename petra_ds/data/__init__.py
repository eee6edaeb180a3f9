"""Data loaders used by the examples.

The vision names load ``.vision`` (and with it torchvision, seconds to import) when first asked for, so that the
text and stream loaders start without it."""

from importlib import import_module
from typing import Any

__all__ = ["INFO", "DataInfo", "Digits", "ImageNet32", "LocalCIFAR10", "build_dataset", "make_loader"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module(".vision", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Data loaders used by the examples."""

from .vision import INFO, DataInfo, Digits, ImageNet32, LocalCIFAR10, build_dataset, make_loader

__all__ = ["INFO", "DataInfo", "Digits", "ImageNet32", "LocalCIFAR10", "build_dataset", "make_loader"]

"""Argument checks with one wording, so every error says the same thing the same way."""

from __future__ import annotations

from typing import Any


def positive_int(value: Any, name: str, error: type[Exception] = ValueError, meaning: str = "") -> None:
    """Raise ``error`` unless ``value`` is an integer >= 1 (a bool is not); ``meaning`` follows the bound,
    e.g. " (PETRA stages per pipeline rank)"."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise error(f"{name} must be an integer >= 1{meaning}, got {value!r}")

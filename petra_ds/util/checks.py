"""Argument checks with one wording, so every error says the same thing the same way."""

from __future__ import annotations

from typing import Any


def int_at_least(lowest: int, value: Any, name: str, error: type[Exception] = ValueError, meaning: str = "") -> None:
    """Raise ``error`` unless ``value`` is an integer >= ``lowest`` (a bool is not); ``meaning`` follows the bound,
    e.g. " (PETRA stages per pipeline rank)"."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise error(f"{name} must be an integer >= {lowest}{meaning}, got {value!r}")


def positive_int(value: Any, name: str, error: type[Exception] = ValueError, meaning: str = "") -> None:
    """:func:`int_at_least` 1."""
    int_at_least(1, value, name, error, meaning)

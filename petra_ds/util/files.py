"""Files written whole or not at all: through a temporary file beside the target, then a rename, so a
reader (or a restarted run) sees the previous file or the new one, never half of one."""

from __future__ import annotations

import os
from typing import IO, Any, Callable

import torch


def replace_atomically(path: str, write: Callable[[IO], None], binary: bool = False) -> None:
    """``write(f)`` into ``<path>.tmp-<pid>``, flushed to disk, then renamed over ``path``. A process that
    dies before the rename leaves ``path`` as it was and a stray temporary file that nothing reads."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb" if binary else "w") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: str, text: str) -> None:
    replace_atomically(path, lambda f: f.write(text))


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` through a temporary file and a rename."""
    replace_atomically(path, lambda f: torch.save(obj, f), binary=True)


def save_figure(fig: Any, path: str, **options: Any) -> None:
    """``fig.savefig(path, **options)`` through a temporary file and a rename (the format from ``path``)."""
    fmt = os.path.splitext(path)[1].lstrip(".") or "png"
    replace_atomically(path, lambda f: fig.savefig(f, format=fmt, **options), binary=True)

"""How an entry point picks its sub-benchmark: a first word names one, no word runs the default. In one place so
that the six entry points read their command lines alike and their help and usage lines name the entry point."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Sequence

#: a sub-benchmark: its ``main``, called with the arguments after its word
Main = Callable[[list[str]], Any]


@contextlib.contextmanager
def program_name(name: str) -> Iterator[None]:
    """``sys.argv[0]`` is ``name`` inside: argparse, which takes its ``prog`` from it, prints it in usage lines."""
    saved = sys.argv[:1]
    sys.argv[:1] = [name]
    try:
        yield
    finally:
        sys.argv[:1] = saved


def dispatch(entry: str, doc: str, default: Main, commands: dict[str, Main], argv: Sequence[str] | None) -> Any:
    """Run the sub-benchmark that the first word of ``argv`` (default: this process's arguments) names in
    ``commands`` with the words after it, or ``default`` with all of them when the first is no name; return what it
    returns. ``-h`` / ``--help`` as the first word prints ``doc`` (the entry point's sub-benchmarks) before the
    default's flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    word = argv[0] if argv and argv[0] in commands else None
    if word is None and argv[:1] in (["-h"], ["--help"]):
        print(doc.strip() + "\n\nThe default sub-benchmark's flags:\n")
    with program_name(f"python -m {entry}" + (f" {word}" if word else "")):
        return (commands[word] if word else default)(argv[1:] if word else argv)

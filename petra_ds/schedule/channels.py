"""The names of what travels between stages: channels and message keys, defined once.

A :class:`Channel` is a directed link ``(kind, source stage, destination stage)``: the transport pairs
messages and negotiates layouts per channel, and traces record it. A :class:`Key` names one message in a
stage's inbox (or, produced and not yet sent, in its outbox): ``(stage, kind, index)`` with ``index`` the
micro-batch, or the optimizer step for tied weights. Both are named tuples, so they compare and hash like
the plain tuples older checkpoints and traces hold. PETRA's instructions (``instructions.py``) build them
through the functions below and the engine, the replay and the time model ask the instruction; the
model of torch's schedules names its virtual stages' channels with :class:`Channel` directly.
"""

from __future__ import annotations

from typing import NamedTuple

ACT = "act"  #: x_j, forward, j -> j + 1 (with the labels)
GRAD = "grad"  #: delta_j (and x~_{j-1} when stage j - 1 reconstructs), backward, j -> j - 1
EVAL = "eval"  #: a forward-only activation of ``eval_batch``
DATA = "data"  #: a micro-batch stage 0 loaded for its forward in the same clock (never sent)
TIED_GRAD = "tied_grad"  #: a reader's gradient of tied weights, to their owner
TIED_WEIGHT = "tied_weight"  #: the owner's new tied weights, to a reader
PROBE_ACT, PROBE_GRAD = "gq_act", "gq_grad"  #: the gradient-quality probe's end-to-end pass


class Channel(NamedTuple):
    kind: str
    src: int
    dst: int

    def __str__(self) -> str:
        return channel_name(self)


def channel_name(channel: tuple[str, int, int]) -> str:
    """``kind:src->dst``, the name traces and error messages use (also for plain tuples)."""
    return f"{channel[0]}:{channel[1]}->{channel[2]}"


class Key(NamedTuple):
    stage: int
    kind: str
    index: int


def forward_channel(stage: int, kind: str = ACT) -> Channel:
    """Stage ``stage``'s output to the next stage."""
    return Channel(kind, stage, stage + 1)


def backward_channel(stage: int, kind: str = GRAD) -> Channel:
    """Stage ``stage``'s input gradient to the previous stage."""
    return Channel(kind, stage, stage - 1)


def tied(kind: str, key: str) -> str:
    """The channel kind of tied weights ``key``: each tie has its own channels (its own layout)."""
    return f"{kind}:{key}"


def tie_of(kind: str) -> tuple[str, str] | None:
    """``(TIED_GRAD or TIED_WEIGHT, tie key)`` of a tied channel kind, else None."""
    base, sep, key = kind.partition(":")
    return (base, key) if sep and base in (TIED_GRAD, TIED_WEIGHT) else None


def tied_grad_channel(key: str, reader: int, owner: int) -> Channel:
    return Channel(tied(TIED_GRAD, key), reader, owner)


def tied_weight_channel(key: str, owner: int, reader: int) -> Channel:
    return Channel(tied(TIED_WEIGHT, key), owner, reader)


def tied_grad_key(owner: int, key: str, reader: int, step: int) -> Key:
    """Reader ``reader``'s gradient of step ``step`` in the owner's inbox."""
    return Key(owner, f"{tied(TIED_GRAD, key)}:{reader}", step)


def tied_weight_key(reader: int, key: str, step: int) -> Key:
    """The owner's weights after step ``step`` in reader ``reader``'s inbox."""
    return Key(reader, tied(TIED_WEIGHT, key), step)


def data_key(micro_batch: int) -> Key:
    """The micro-batch ``micro_batch`` stage 0 loaded, in its own inbox."""
    return Key(0, DATA, micro_batch)


def forward_key(stage: int, micro_batch: int, kind: str = ACT) -> Key:
    """Stage ``stage``'s output for ``micro_batch``, as the next stage's inbox names it."""
    return Key(stage + 1, kind, micro_batch)


def backward_key(stage: int, micro_batch: int, kind: str = GRAD) -> Key:
    """Stage ``stage``'s input gradient for ``micro_batch``, as the previous stage's inbox names it."""
    return Key(stage - 1, kind, micro_batch)

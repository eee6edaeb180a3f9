"""Where a NaN or Inf first appeared in training, named as such: a micro-batch, an activation, a
reconstruction, a loss or a gradient, with its stage, micro-batch and clock, and what to check.

Met later, a NaN is misread: a round trip through it fails for any inverse, a loss through it sends the
user to the loss. So each stage checks what it reads and makes, where it makes it (``Stage`` calls the
watch). The checks stay on the device: one scalar per value, max |x|, which is NaN if the value holds a
NaN and Inf if it holds an Inf. The host reads them in one transfer per ``train_batch`` window, where the
engine synchronises for the loss anyway, and earlier only when an optimizer step's gradient check, which
synchronises already, finds a non-finite gradient. No host-device synchronisation is added per clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from deepspeed.utils import logger
from torch import Tensor

from ..nn.check import NonFiniteError
from ..util.nested import tensors_in

#: what to check first, by kind
_CHECK = {
    "micro-batch": "Check the data pipeline (the dataset, its transforms, the collate function): this is the "
                   "data stage 0 read, nothing had been computed from it yet",
    "activation": "Check the learning rate (weights that diverged), the layers of stage {stage} (an exp, a log "
                  "or a division that overflows) and mixed precision (a bf16 overflow)",
    "loss": "Check the loss function and the labels, the data, then the learning rate",
    "reconstruction": "The output it inverted was finite, so this is not a wrong inverse: inverting its layers "
                      "with the weights as they are now overflowed. Lower the learning rate, try "
                      '"delay_compensation": "weight_prediction", or keep this stage\'s inputs '
                      '("input_buffer": "all")',
    "gradient": 'Check the learning rate, the scale of the loss (a sum where a mean was meant), "gradient_clipping" '
                "and, under bf16, mixed precision",
}

_TRAIN_ON = (' ("petra": {"non_finite": "skip"} skips the updates it poisons and trains on; "check_finite": '
             "false stops checking micro-batches, activations, reconstructions and gradients.)")


@dataclass(frozen=True)
class Sighting:
    """One value checked: what it is and where training made it."""

    kind: str
    what: str
    stage: int
    micro_batch: int
    clock: int
    #: the stage, on another rank, whose message this value was computed from (None: this rank's own)
    sender: int | None = None

    def message(self, value: str) -> str:
        """The error's text for this value holding ``value`` ("NaN" or "Inf")."""
        where = f"stage {self.stage}, micro-batch {self.micro_batch}, clock {self.clock}"
        text = f"non-finite {self.kind} at {where}: {value} in {self.what}. " \
               f"{_CHECK[self.kind].format(stage=self.stage)}."
        if self.sender is not None:
            text += (f" What it was computed from came from stage {self.sender}, on another rank: if that rank "
                     "stopped with a NonFiniteError too, its message names where this began.")
        return text


def float_tensors(values: Any) -> list[Tensor]:
    """The non-empty floating-point tensors inside ``values`` (nested), detached."""
    return [t.detach() for t in tensors_in(values) if t.is_floating_point() and t.numel()]


def largest_magnitude(tensors: Sequence[Tensor]) -> Tensor:
    """max |x| over ``tensors``, one float32 scalar on their device: NaN if one holds a NaN, else Inf if one
    holds an Inf. Reductions only, no host synchronisation. Read from each tensor's minimum and maximum
    (max |x| = max(max x, -min x), NaN kept): one vectorised pass, where the inf-norm is a scalar loop on CPU
    (10x slower on a stage's gradients; 3-6% of PETRA's RevGPT throughput on 2 CPU ranks)."""
    with torch.no_grad():
        ends = _stack([torch.stack(torch.aminmax(t)).float() for t in tensors])
        return torch.maximum(ends.amax(), -ends.amin())


def _stack(values: Sequence[Tensor]) -> Tensor:
    """The values as one tensor (stacked on a new first dimension), on a GPU if one of them is on it (a data
    dict can stay on the host)."""
    device = next((v.device for v in values if v.device.type != "cpu"), values[0].device)
    return torch.stack([v.to(device) for v in values])


class FiniteWatch:
    """One rank's non-finite checks, shared by its stages; read with :meth:`check`.

    ``check_finite`` (the ``"petra"`` key) checks micro-batches, activations, reconstructions and gradients;
    losses are checked as well whenever ``non_finite`` is "raise" (what that key promised before this
    watch existed). ``clock`` returns the engine's clock now; ``local_stages`` are this rank's stages."""

    def __init__(self, clock: Callable[[], int], local_stages: Iterable[int], num_stages: int, *,
                 check_finite: bool = True, non_finite: str = "raise") -> None:
        self._clock = clock
        self._local = set(local_stages)
        self._num_stages = num_stages
        self.check_finite = check_finite
        self.non_finite = non_finite
        self._seen: list[Sighting] = []
        self._largest: list[Tensor] = []  # device scalars, one per entry of _seen

    @classmethod
    def off(cls) -> "FiniteWatch":
        """A watch that checks nothing (a ``Stage`` outside an engine)."""
        return cls(lambda: -1, (), 0, check_finite=False, non_finite="skip")

    # --- what the stages report ---

    def micro_batch(self, m: int, inputs: Any, labels: Any) -> None:
        """Stage 0's data: its inputs, and its labels when they are floating point."""
        self._see("micro-batch", "its inputs", 0, m, inputs)
        self._see("micro-batch", "its labels", 0, m, labels)

    def activation(self, stage: int, m: int, y: Any) -> None:
        """A stage's forward output, which it sends to the next stage."""
        self._see("activation", f"the output of stage {stage}'s forward", stage, m, y, sender=stage - 1)

    def loss(self, stage: int, m: int, loss: Tensor) -> None:
        """The last stage's loss (also with ``check_finite`` off, under ``non_finite: "raise"``)."""
        if self.check_finite or self.non_finite == "raise":
            self._record("loss", "the loss", stage, m, loss, sender=stage - 1)

    def reconstruction(self, stage: int, m: int, x: Any) -> None:
        """The input a reversible stage rebuilt by inverting its layers (it sends it upstream)."""
        self._see("reconstruction", "the input it rebuilt by inverting its layers", stage, m, x, sender=stage + 1)

    def gradients(self, stage: int, m: int, params: Sequence[Tensor], dx: Any) -> None:
        """After a backward: the parameters' gradients accumulated so far (clean until this micro-batch, or an
        earlier check would have seen them) and the input gradient a stage other than 0 sends upstream."""
        grads = [p.grad for p in params if p.grad is not None]
        self._see("gradient", "the gradient of its parameters", stage, m, grads, sender=stage + 1)
        if stage > 0:
            self._see("gradient", f"the input gradient it sends to stage {stage - 1}", stage, m, dx,
                      sender=stage + 1)

    def _see(self, kind: str, what: str, stage: int, m: int, values: Any, sender: int | None = None) -> None:
        if self.check_finite:
            self._record(kind, what, stage, m, values, sender)

    def _record(self, kind: str, what: str, stage: int, m: int, values: Any, sender: int | None = None) -> None:
        tensors = float_tensors(values)
        if not tensors:
            return
        remote = sender is not None and 0 <= sender < self._num_stages and sender not in self._local
        self._seen.append(Sighting(kind, what, stage, m, self._clock(), sender if remote else None))
        self._largest.append(largest_magnitude(tensors))

    # --- what the engine reads ---

    def first(self) -> tuple[Sighting, str] | None:
        """The first value recorded since the last read that holds a NaN or Inf, with "NaN" or "Inf"; None if
        every one is finite. One host synchronisation; the records are forgotten."""
        seen, largest = self._seen, self._largest
        self._seen, self._largest = [], []
        if not seen:
            return None
        for sighting, value in zip(seen, _stack(largest).tolist()):
            if not math.isfinite(value):
                return sighting, "NaN" if math.isnan(value) else "Inf"
        return None

    def check(self) -> None:
        """Raise :class:`NonFiniteError` for the first non-finite value recorded since the last read
        (``non_finite: "raise"``), or log it and train on (``"skip"``: the optimizer steps it poisons are
        skipped)."""
        found = self.first()
        if found is None:
            return
        sighting, value = found
        text = sighting.message(value)
        if self.non_finite != "raise":
            logger.warning(f'{text} ("non_finite": "skip": training goes on without the updates it poisons)')
            return
        raise NonFiniteError(text + _TRAIN_ON, kind=sighting.kind, stage=sighting.stage,
                             micro_batch=sighting.micro_batch, clock=sighting.clock, value=value)


def gradients_finite(params: list[Tensor], where: str, non_finite: str, earlier: Callable[[], None]) -> bool:
    """One check per step (not per micro-batch): are the k accumulated gradients finite? With
    ``non_finite: "raise"`` a non-finite one raises before the optimizer could write NaN, after ``earlier()``
    (``FiniteWatch.check``) has raised for the value that went non-finite first, if it saw one."""
    grads = float_tensors([p.grad for p in params])
    if not grads or bool(largest_magnitude(grads).isfinite()):
        return True
    if non_finite == "raise":
        earlier()
        raise NonFiniteError(
            f"non-finite gradient at {where}, no earlier NaN or Inf seen on this rank: it came in with the "
            "data-parallel average or a tied weight's gradient (another rank's NonFiniteError names its origin), "
            'or "check_finite" is off. Set "petra": {"non_finite": "skip"} to skip such updates', kind="gradient")
    return False

"""Where a NaN or Inf first appeared in training, named as such: a micro-batch, an activation, a
reconstruction, a loss or a gradient, with its stage, micro-batch and clock, and what to check.

Met later, a NaN is misread: a round trip through it fails for any inverse, a loss through it sends the user to the
loss. So each stage checks what it reads and makes, where it makes it (``Stage`` calls the watch). The checks stay
on the device: one scalar per tensor, max |x|, which is NaN if the tensor holds a NaN and Inf if it holds an Inf,
reduced in a fused reduction per clock and step (one per dtype and layout of the tensors). The host reads them once
per ``train_batch`` window, in the transfer that reads the window's loss. An optimizer step is guarded without the
host: its gradients' check is a device flag, and an optimizer that can skip on the device (torch's fused ones,
``skips_on_device``) is handed it as ``found_inf``; any other optimizer makes the engine read the flag (one host
synchronisation per step). So no step applies a non-finite gradient, and the value that went non-finite first is
named, with its stage, micro-batch and clock, at the end of the window.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch
from deepspeed.utils import logger
from torch import Tensor

from ..nn.accumulate import REQUIRES_GRAD
from ..nn.check import NonFiniteError
from ..util.grad_mode import no_grad
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
    "step": "No earlier NaN or Inf was seen on this rank: it came in with the data-parallel average or a tied "
            "weight's gradient (another rank's NonFiniteError names its origin), or \"check_finite\" is off",
    "gradient": 'Check the learning rate, the scale of the loss (a sum where a mean was meant), "gradient_clipping" '
                "and, under bf16, mixed precision",
    "minimum scale": 'fp16\'s loss scale of stage {stage} is at "min_loss_scale" and its gradients still overflow, so '
                     "no lower scale helps: check the learning rate and the loss, lower \"min_loss_scale\", or train "
                     "in bf16 or fp32",
}

_TRAIN_ON = (' ("petra": {"non_finite": "skip"} skips the updates it poisons and trains on; "check_finite": '
             "false stops checking micro-batches, activations, reconstructions and gradients.)")


class Sighting(NamedTuple):
    """One value checked: what it is and where training made it. The watch keeps each report as one whose ``what``
    is still a template for ``str.format`` of ``stage``, ``previous`` (stage - 1) and ``step``; :meth:`written`
    fills it in for the one a read names (a clock reports a few values per stage, a read names one at most)."""

    kind: str
    what: str
    stage: int
    micro_batch: int
    clock: int
    #: the stage, on another rank, whose message this value was computed from (None: this rank's own)
    sender: int | None = None
    #: the optimizer step these gradients guard (None: no step's)
    step: int | None = None
    #: which advice of ``_CHECK`` the message gives (None: its kind's)
    hint: str | None = None

    def message(self, value: str) -> str:
        """The error's text for this value holding ``value`` ("NaN" or "Inf")."""
        where = f"stage {self.stage}, micro-batch {self.micro_batch}, clock {self.clock}"
        hint = _CHECK[self.hint or self.kind].format(stage=self.stage)
        text = f"non-finite {self.kind} at {where}: {value} in {self.what}. {hint}."
        if self.sender is not None:
            text += (f" What it was computed from came from stage {self.sender}, on another rank: if that rank "
                     "stopped with a NonFiniteError too, its message names where this began.")
        return text

    def for_step(self, step: int) -> "Sighting":
        """This sighting, of the gradients optimizer step ``step`` is about to apply."""
        return self._replace(step=step)

    def written(self) -> "Sighting":
        """This sighting with its description written out."""
        return self._replace(what=self.what.format(stage=self.stage, previous=self.stage - 1, step=self.step))


#: a :class:`Sighting` made from its fields without the named tuple's Python-level constructor
_new_sighting = tuple.__new__
#: a pending report's sighting and tensors
_SIGHTING, _TENSORS = operator.itemgetter(0), operator.itemgetter(1)


def float_tensors(values: Any) -> list[Tensor]:
    """The non-empty floating-point tensors inside ``values`` (nested), as they are: they are only reduced,
    under ``no_grad``, so no detached view (one more op per tensor) is made."""
    if isinstance(values, Tensor):  # the usual report: one tensor, or a flat pair (no walk then)
        return [values] if values.is_floating_point() and values.numel() else []
    if not (isinstance(values, tuple) and all(map(isinstance, values, itertools.repeat(Tensor)))):
        values = tensors_in(values)
    # filtered in passes that run in C: a clock reports a few values per stage, each a tensor or two
    return list(itertools.compress(values, map(operator.and_, map(Tensor.is_floating_point, values),
                                               map(bool, map(Tensor.numel, values)))))


def fusable(t: Tensor) -> bool:
    """Whether CUDA's multi-tensor (``_foreach_*``) kernels can take ``t`` in a fused pass: dense (contiguous, or
    channels-last). A list holding a tensor that is not, or tensors of several dtypes, goes tensor by tensor."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def max_abs_each(tensors: Sequence[Tensor]) -> tuple[Tensor, list[int] | None]:
    """max |x| of each tensor, as one float32 vector on their device (NaN where a tensor holds a NaN, else Inf where
    it holds an Inf), and the position in ``tensors`` of each entry (None: in their order). No host synchronisation."""
    maxima, order = max_abs_parts(tensors)
    return torch.stack(maxima).float(), order


def max_abs_parts(tensors: Sequence[Tensor]) -> tuple[list[Tensor], list[int] | None]:
    """:func:`max_abs_each`'s entries as they come out of the reduction, one scalar tensor each, not yet stacked: a
    watch stacks those of a whole window at once.

    The tensors are reduced in groups that share a device and a dtype and are each :func:`fusable`, one fused pass per
    group, the groups' entries one after the other: torch's CUDA foreach norm is one pass only over such a list,
    and given one tensor that is not (the halves of a coupling's output across channels) it reduces the whole list
    tensor by tensor (on an H200, 218 reductions and 206 memsets a RevNet18 call). On CUDA the foreach infinity
    norm; on the CPU, where that norm is a scalar loop 10x slower than a vectorised one, the foreach maximum of the
    foreach absolute values. Tensors on several devices (a data dict left on the host) end on a GPU's."""
    if any(map(REQUIRES_GRAD, tensors)):  # a loss: its reduction joins no graph
        with no_grad():
            return _max_abs_parts(tensors)
    return _max_abs_parts(tensors)


def _max_abs_parts(tensors: Sequence[Tensor]) -> tuple[list[Tensor], list[int] | None]:
    """:func:`max_abs_parts` in the grad mode it is called in."""
    # a group's key per tensor, in passes that run in C: the per-tensor loop of a clock's flush is the watch's cost
    dense = list(map(Tensor.is_contiguous, tensors))
    for i in itertools.compress(range(len(dense)), map(operator.not_, dense)):
        dense[i] = fusable(tensors[i])  # channels-last, or not dense at all
    keys = list(zip(map(_PLACE, tensors), dense))
    codes = {key: code for code, key in enumerate(dict.fromkeys(keys))}  # the groups, by first appearance
    if len(codes) == 1:
        return _max_abs_on_one_device(tensors), None
    code_of = list(map(codes.__getitem__, keys))
    order = sorted(range(len(tensors)), key=code_of.__getitem__)  # stable: reported order within a group
    ordered = list(map(tensors.__getitem__, order))
    target = next((device for (device, _), _ in codes if device.type != "cpu"), tensors[0].device)
    parts, start = [], 0
    for code in range(len(codes)):
        end = start + code_of.count(code)
        maxima = _max_abs_on_one_device(ordered[start:end])
        parts.extend(maxima if maxima[0].device == target else torch.stack(maxima).to(target).unbind())
        start = end
    return parts, order


#: a tensor's device and dtype (a group of :func:`max_abs_parts` shares them)
_PLACE = operator.attrgetter("device", "dtype")


def _max_abs_on_one_device(tensors: Sequence[Tensor]) -> list[Tensor]:
    if tensors[0].is_cuda:
        return list(torch._foreach_norm(tensors, math.inf, dtype=torch.float32))
    return list(torch._foreach_max(torch._foreach_abs(tensors)))


class FiniteWatch:
    """One rank's non-finite checks, shared by its stages; read with :meth:`check`.

    ``check_finite`` (the ``"petra"`` key) checks micro-batches, activations, reconstructions and gradients;
    losses are checked as well whenever ``non_finite`` is "raise" (what that key promised before this
    watch existed), and every optimizer step's gradients always. ``clock`` returns the engine's clock now;
    ``local_stages`` are this rank's stages.

    What the stages report waits, by reference, until :meth:`flush` reduces all of it in a fused reduction
    (the engine flushes at the end of each clock, and before a data-parallel average or a tied weight's
    gradient rewrites gradients a backward reported): a handful of kernels per clock instead of a few per
    value and tensor. With ``message_offload`` the inbox also flushes before a message leaves the device
    (``transport.Inbox``): a reference held to the end of the clock would keep its device copy there (every message
    of a clock at once, on one GPU hosting every stage)."""

    def __init__(self, clock: Callable[[], int], local_stages: Iterable[int], petra_stages: int, *,
                 check_finite: bool = True, non_finite: str = "raise", scaled: bool = False) -> None:
        self._clock = clock
        #: the stages on other ranks: a value computed from their message names its sender
        self._remote = frozenset(range(petra_stages)) - set(local_stages)
        self.check_finite = check_finite
        self.non_finite = non_finite
        #: fp16's dynamic loss scaling: a gradient overflow is the scale's to handle (a skipped step and a lower
        #: scale, counted, not an error) but at the minimum scale (:meth:`overflow_at_minimum`)
        self.scaled = scaled
        self._seen: list[Sighting] = []  # one per tensor reduced, in the order reported
        self._maxima: list[Tensor] = []  # one device scalar per tensor reduced, stacked when the window is read
        self._positions: list[int] = []  # the position in _seen of each entry of _maxima
        self._pending: list[list] = []  # [sighting, tensors] in the order reported
        #: per stage, its report of the gradients accumulated by this clock's backward (also in _pending)
        self._backward_gradients: dict[int, list] = {}
        #: (stage, step) of the optimizer steps skipped for non-finite gradients, as the reads found them
        self.skipped_steps: list[tuple[int, int]] = []

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
        self._see("activation", "the output of stage {stage}'s forward", stage, m, y, sender=stage - 1)

    def loss(self, stage: int, m: int, loss: Tensor) -> None:
        """The last stage's loss (also with ``check_finite`` off, under ``non_finite: "raise"``)."""
        if self.check_finite or self.non_finite == "raise":
            self._record("loss", "the loss", stage, m, stage - 1, loss)

    def reconstruction(self, stage: int, m: int, x: Any) -> None:
        """The input a reversible stage rebuilt by inverting its layers (it sends it upstream)."""
        self._see("reconstruction", "the input it rebuilt by inverting its layers", stage, m, x, sender=stage + 1)

    def gradients(self, stage: int, m: int, grads: Sequence[Tensor], dx: Any) -> None:
        """After a backward: the parameters' gradients accumulated so far (clean until this micro-batch, or an
        earlier check would have seen them; ``StageGrads.tensors``) and the input gradient a stage other than 0
        sends upstream."""
        if not self.check_finite or self.scaled:
            return
        grads = list(itertools.compress(grads, map(Tensor.numel, grads)))  # a parameter's is floating
        if grads:
            report = [self._sighting("gradient", "the gradient of its parameters", stage, m, stage + 1), grads]
            self._pending.append(report)
            self._backward_gradients[stage] = report
        if stage > 0:
            self._see("gradient", "the input gradient it sends to stage {previous}", stage, m, dx, sender=stage + 1)

    def step(self, stage: int, step: int, m: int, grads: Sequence[Tensor],
             norm: Tensor | None = None) -> Tensor | None:
        """Before optimizer step ``step`` of ``stage`` (``m``: its last micro-batch): 1.0 where a gradient it is
        about to apply (data-parallel average and tied weights' gradients included) holds a NaN or Inf, else
        0.0, as a float32 device scalar (torch's ``found_inf``); None without gradients. ``norm``: their total
        norm, already computed (gradient clipping), which is non-finite exactly then (or, in the way
        ``GradScaler`` and DeepSpeed read an overflow, where the squares overflow). Checked whatever
        ``check_finite`` says: it guards the step.

        The same gradients were reported by this clock's backward, unless something rewrote them since (the
        engine then flushed them): that report, in its place among the clock's, becomes this one, so they are
        reduced once."""
        grads = float_tensors(grads)
        if not grads:
            return None
        with no_grad():
            value = max_abs_each(grads)[0].amax() if norm is None else norm.float()
            found_inf = torch.nan_to_num(value * 0, nan=1.0)
        report = self._backward_gradients.pop(stage, None)
        if report is not None:
            report[:] = [report[0].for_step(step), [value]]
        else:
            self._pending.append([Sighting("overflow" if self.scaled else "gradient",
                                           "the gradients of its optimizer step {step}", stage, m, self._clock(),
                                           step=step, hint="step"), [value]])
        return found_inf

    def overflow_at_minimum(self, stage: int, step: int, m: int, unhandled: Tensor) -> None:
        """Under dynamic loss scaling, after step ``step`` of ``stage``: ``unhandled`` (a device bool) says its
        gradients overflowed at the minimum loss scale, an error then."""
        self._pending.append([Sighting("gradient", "the gradients of its optimizer step {step}", stage, m,
                                       self._clock(), step=step, hint="minimum scale"),
                              [torch.where(unhandled, math.inf, 0.0)]])

    def flush_gradients(self) -> None:
        """Flush before something rewrites the gradients that backwards reported (a data-parallel average, a
        tied weight's gradient)."""
        if self._backward_gradients:
            self.flush()

    def _see(self, kind: str, what: str, stage: int, m: int, values: Any, sender: int | None = None) -> None:
        if self.check_finite:
            self._record(kind, what, stage, m, sender, values)

    def _sighting(self, kind: str, what: str, stage: int, m: int, sender: int | None) -> Sighting:
        """A report's sighting, made without the named tuple's constructor in Python (a clock makes a few a stage)."""
        return _new_sighting(Sighting, (kind, what, stage, m, self._clock(), sender if sender in self._remote else None,
                                        None, None))

    def _record(self, kind: str, what: str, stage: int, m: int, sender: int | None, values: Any) -> None:
        tensors = float_tensors(values)
        if tensors:
            self._pending.append([self._sighting(kind, what, stage, m, sender), tensors])

    def flush(self) -> None:
        """Reduce what was reported since the last flush to one max |x| per tensor, on the device. The values
        must not change before their flush: the engine flushes before a step rewrites the gradients."""
        self._backward_gradients.clear()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        seen, tensors = self._seen, []
        base = len(seen)
        reported = list(map(_TENSORS, pending))
        tensors = list(itertools.chain.from_iterable(reported))
        seen.extend(itertools.chain.from_iterable(map(itertools.repeat, map(_SIGHTING, pending), map(len, reported))))
        maxima, order = max_abs_parts(tensors)
        self._maxima.extend(maxima)
        self._positions.extend(range(base, base + len(tensors)) if order is None else map(base.__add__, order))

    # --- what the engine reads ---

    def take(self) -> Tensor | None:
        """Everything recorded since the last read, reduced, as one float32 device vector (None if nothing
        was): the engine reads it in the transfer that reads the window's loss, and hands it to :meth:`report`."""
        self.flush()
        if not self._maxima:
            return None
        return torch.stack(self._maxima).float()

    def report(self, values: Sequence[float]) -> tuple[Sighting, str] | None:
        """Given the host values of :meth:`take`'s vector: note the skipped steps, forget the records, and
        return the first value that holds a NaN or Inf, with "NaN" or "Inf" (None if all are finite)."""
        seen, positions = self._seen, self._positions
        self._seen, self._maxima, self._positions = [], [], []
        found, skipped = None, []
        if math.isfinite(sum(values)):  # maxima of |x|: their sum is finite exactly when each is
            return None
        for position, value in sorted((p, v) for p, v in zip(positions, values) if not math.isfinite(v)):
            sighting = seen[position].written()
            if sighting.kind == "overflow":
                logger.info(f"fp16: the gradients of stage {sighting.stage}'s optimizer step {sighting.step} "
                            "overflowed; the step was skipped and its loss scale lowered")
            else:
                found = found or (sighting, "NaN" if math.isnan(value) else "Inf")
            if sighting.step is not None and (sighting.stage, sighting.step) not in skipped:
                skipped.append((sighting.stage, sighting.step))
        self.skipped_steps.extend(skipped)
        return found

    def first(self) -> tuple[Sighting, str] | None:
        """The first value recorded since the last read that holds a NaN or Inf (see :meth:`report`). One host
        synchronisation."""
        vector = self.take()
        return None if vector is None else self.report(vector.tolist())

    def check(self) -> None:
        """:meth:`first`, then :meth:`raise_or_log` it."""
        self.raise_or_log(self.first())

    def raise_or_log(self, found: tuple[Sighting, str] | None) -> None:
        """Raise :class:`NonFiniteError` for ``found`` (``non_finite: "raise"``), or log it and train on
        (``"skip"``: the optimizer steps it poisons are skipped)."""
        if found is None:
            return
        sighting, value = found
        text = sighting.message(value)
        if self.non_finite != "raise":
            logger.warning(f'{text} ("non_finite": "skip": training goes on without the updates it poisons)')
            return
        raise NonFiniteError(text + _TRAIN_ON, kind=sighting.kind, stage=sighting.stage,
                             micro_batch=sighting.micro_batch, clock=sighting.clock, value=value)


def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer`` can skip a step on the device: torch's fused optimizers (Adam, AdamW, SGD, ...)
    read ``found_inf`` (as set by ``torch.amp.GradScaler``) and leave parameters, state and step count
    untouched where it is non-zero."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and \
        bool(getattr(optimizer, "defaults", {}).get("fused"))


def fresh_momentum(optimizer: Any) -> bool:
    """Whether ``optimizer`` is torch's SGD with momentum before its first step has made every momentum buffer. The
    fused SGD makes them with ``empty_like`` on that step, so one it skips on the device (``found_inf``) leaves them
    uninitialised, and the next step reads that memory (NaN weights on a CPU, fp16's usual early overflow on a GPU):
    such a step is guarded by a host read instead."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    return any(group["momentum"] and any("momentum_buffer" not in optimizer.state.get(p, ())
                                         for p in group["params"]) for group in optimizer.param_groups)

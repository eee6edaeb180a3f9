"""A NaN or Inf is named where it first appears (``petra_ds.runtime.finite``): what it is (a micro-batch, an
activation, a reconstruction, a loss, a gradient; NaN or Inf), its stage, micro-batch and clock, never as a
wrong inverse; ``"check_finite": false`` turns the checks off.

Every engine here hosts its J = 3 stages in this process, one layer each: stage 0 a ``Carry`` (a Linear
that starts as the identity, so a marked row stays marked), stage 1 the layer under test, stage 2 a head.
A row is marked by a first feature of 1000 (finite); stage 1's layers misbehave on marked rows only.
"""

import itertools
import logging
import math

import pytest
import torch
from deepspeed.runtime.pipe.module import LayerSpec
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from deepspeed.utils import logger
from torch import nn

import petra_ds
from petra_ds.nn import AdditiveCoupling, Reversible, ReversibilityError, check_reversible
from petra_ds.runtime.observe import Observer
from petra_ds.schedule import backward_micro_batch, forward_micro_batch
from petra_ds.tools.toy import CLASSES, IN_FEATURES, toy_data, toy_layer_specs

J, K, MARKED = 3, 2, 3  # stages, micro-batches per train_batch, the micro-batch that misbehaves
MARK = 1000.0


def forward_clock(m: int, stage: int) -> int:
    """The clock at which ``stage`` runs micro-batch ``m``'s forward, by the schedule's own equation."""
    return next(t for t in itertools.count() if forward_micro_batch(t, stage) == m)


def backward_clock(m: int, stage: int) -> int:
    """The clock at which ``stage`` runs micro-batch ``m``'s backward (and a reversible stage its
    reconstruction), by the schedule's own equation."""
    return next(t for t in itertools.count() if backward_micro_batch(t, stage, J) == m)


def marked(x: torch.Tensor) -> torch.Tensor:
    return x[:, :1] > MARK / 10


class Carry(nn.Linear):
    def __init__(self) -> None:
        super().__init__(IN_FEATURES, IN_FEATURES)
        with torch.no_grad():
            self.weight.copy_(torch.eye(IN_FEATURES))
            self.bias.zero_()


class Spike(nn.Linear):
    """Its output is +Inf on marked rows (an overflow in the forward)."""

    def __init__(self) -> None:
        super().__init__(IN_FEATURES, IN_FEATURES)

    def forward(self, x):
        return torch.where(marked(x), torch.inf, super().forward(x))


class _NanBackward(torch.autograd.Function):
    """The identity, whose backward writes NaN on marked rows."""

    @staticmethod
    def forward(ctx, y, rows):
        ctx.save_for_backward(rows)
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return torch.where(rows, torch.nan, grad), None


class Poison(nn.Linear):
    """Finite forward; the backward of a marked row is NaN, entering before the Linear (the parameters'
    gradients are NaN) or after it (only the input gradient it sends upstream)."""

    def __init__(self, where: str) -> None:
        super().__init__(IN_FEATURES, IN_FEATURES)
        self.where = where

    def forward(self, x):
        if self.where == "nowhere":
            return super().forward(x)
        if self.where == "input":
            return super().forward(_NanBackward.apply(x, marked(x)))
        return _NanBackward.apply(super().forward(x), marked(x))


class Leaky(Reversible):
    """y = x * exp(s); its inverse returns Inf on marked rows (an inverse that overflows): stage 1 is a
    reversible middle stage, so it rebuilds its input by inverting this layer."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x * self.s.exp()

    def inverse(self, y):
        return torch.where(marked(y), torch.inf, y * (-self.s).exp())


class Head(nn.Linear):
    def __init__(self) -> None:
        super().__init__(IN_FEATURES, CLASSES)

    def forward(self, x):
        return super().forward(torch.tanh(x))


def engine_with(middle: LayerSpec, petra: dict | None = None, specs: list | None = None, stages: int = J,
                optimizer: dict | None = None):
    model = petra_ds.PetraPipelineModule(
        specs or [LayerSpec(Carry), middle, LayerSpec(Head)], topology=PipeDataParallelTopology(num_pp=1, num_dp=1),
        loss_fn=nn.CrossEntropyLoss(), stages_per_rank=stages, partition_method="uniform", base_seed=1234)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": K, "steps_per_print": 10**9,
              "optimizer": optimizer or {"type": "SGD", "params": {"lr": 0.01}},
              "petra": {"stages_per_rank": stages, **(petra or {})}}
    engine, *_ = petra_ds.initialize(model=model, config=config)
    return engine


def data(marked_value: float = MARK, m: int = MARKED) -> list[tuple]:
    batches = toy_data(4 * K, 4, dtype=torch.float32)
    x, y = batches[m]
    x = x.clone()
    x[0, 0] = marked_value
    batches[m] = (x, y)
    return batches


def train(engine, batches) -> list[float]:
    """Every micro-batch, then a drain: each marked micro-batch has had its backward at every stage."""
    it = iter(batches)
    losses = [engine.train_batch(it).item() for _ in range(len(batches) // K)]
    return losses + [engine.drain().item()]


def raised(engine, batches) -> petra_ds.NonFiniteError:
    with pytest.raises(petra_ds.NonFiniteError) as err:
        train(engine, batches)
    message = str(err.value)
    assert "does not invert" not in message and "check_finite" in message
    return err.value


@pytest.mark.parametrize("value, name", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_a_non_finite_micro_batch_is_named_with_its_stage_micro_batch_and_clock(world_of_one, value, name):
    error = raised(engine_with(LayerSpec(Poison, "nowhere")), data(value))
    clock = forward_clock(MARKED, 0)  # micro-batch m enters stage 0 at clock m: 3
    assert str(error).startswith(
        f"non-finite micro-batch at stage 0, micro-batch {MARKED}, clock {clock}: {name} in its inputs. "
        "Check the data pipeline")
    assert (error.kind, error.stage, error.micro_batch, error.clock, error.value) == \
        ("micro-batch", 0, MARKED, clock, name)


def test_a_non_finite_activation_is_named_at_the_stage_that_made_it(world_of_one):
    error = raised(engine_with(LayerSpec(Spike)), data())
    clock = forward_clock(MARKED, 1)  # stage 1 runs micro-batch 3's forward at clock 3 + 1
    assert str(error).startswith(
        f"non-finite activation at stage 1, micro-batch {MARKED}, clock {clock}: Inf in the output of stage 1's "
        "forward. Check the learning rate")
    assert "mixed precision" in str(error)
    assert (error.kind, error.stage, error.micro_batch, error.clock) == ("activation", 1, MARKED, clock)


@pytest.mark.parametrize("where, what", [("output", "the gradient of its parameters"),
                                         ("input", "the input gradient it sends to stage 0")])
def test_a_non_finite_gradient_is_named_at_the_stage_that_computed_it(world_of_one, where, what):
    error = raised(engine_with(LayerSpec(Poison, where)), data())
    clock = backward_clock(MARKED, 1)  # tau_1 = 2(J-1-1) = 2 clocks after its forward at clock 4: 6
    assert str(error).startswith(
        f"non-finite gradient at stage 1, micro-batch {MARKED}, clock {clock}: NaN in {what}. Check the "
        "learning rate, the scale of the loss")
    assert (error.kind, error.stage, error.micro_batch, error.clock) == ("gradient", 1, MARKED, clock)


def test_a_non_finite_reconstruction_is_named_as_such_not_as_a_wrong_inverse(world_of_one):
    error = raised(engine_with(LayerSpec(Leaky)), data())
    clock = backward_clock(MARKED, 1)  # the reconstruction runs in the backward's clock
    assert str(error).startswith(
        f"non-finite reconstruction at stage 1, micro-batch {MARKED}, clock {clock}: Inf in the input it rebuilt "
        "by inverting its layers. The output it inverted was finite, so this is not a wrong inverse")
    assert (error.kind, error.stage, error.micro_batch, error.clock) == ("reconstruction", 1, MARKED, clock)


def test_a_nan_in_the_first_micro_batch_is_not_reported_by_the_reversibility_check(world_of_one):
    """The toy model's stage 0 holds a coupling, checked on its first input: micro-batch 0, here with a NaN.
    The check must not be the one to report it (as a wrong inverse, or as the input of a layer)."""
    batches = toy_data(2 * K, 4, dtype=torch.float32)
    batches[0][0][1, 2] = float("nan")
    engine = engine_with(None, specs=toy_layer_specs(), stages=4)
    with pytest.raises(petra_ds.NonFiniteError,
                       match=r"^non-finite micro-batch at stage 0, micro-batch 0, clock 0: NaN in its inputs"):
        train(engine, batches)


def test_check_finite_false_lets_the_run_go_on(world_of_one):
    """The run that raised for the Inf activation trains to the end with the check off: the head's tanh
    turns the Inf into a finite loss and zero gradients, so no other check stops it."""
    engine = engine_with(LayerSpec(Spike), petra={"check_finite": False})
    losses = train(engine, data())
    assert all(loss == loss for loss in losses[1:])  # the first window only filled the pipeline
    assert all(bool(p.isfinite().all()) for p in engine.module.parameters())
    assert engine.stages.finite.first() is None  # nothing was recorded


def test_under_non_finite_skip_the_first_non_finite_value_is_logged_and_training_goes_on(world_of_one):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        train(engine_with(LayerSpec(Spike), petra={"non_finite": "skip"}), data())
    finally:
        logger.removeHandler(handler)
    warned = [r.getMessage() for r in records if "non-finite" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(
        f"non-finite activation at stage 1, micro-batch {MARKED}, clock {forward_clock(MARKED, 1)}: Inf")


def test_over_two_ranks_the_rank_that_saw_it_names_it():
    """Stage 0 (rank 0 of a two-rank pipeline) reads the NaN micro-batch and stops with the error naming it;
    rank 1 is not told (it fails on the lost connection), which the README says."""
    from harness import launch

    spec = {"pipe": 2, "stages_per_rank": 2, "k": K, "train_batches": 4, "nan_micro_batch": MARKED,
            "capture_grads": False}
    with pytest.raises(RuntimeError) as err:
        launch(spec, timeout=90)
    rank0 = str(err.value).split("rank 1 failed")[0]
    assert f"NonFiniteError: non-finite micro-batch at stage 0, micro-batch {MARKED}, clock " \
        f"{forward_clock(MARKED, 0)}: NaN in its inputs" in rank0


def test_the_reversibility_check_names_non_finite_values_as_such():
    """A NaN input is a NonFiniteError (still a FloatingPointError); an inverse that makes a NaN of finite
    values is a wrong inverse, and the error says NaN instead of printing a NaN error bound."""
    layer = AdditiveCoupling(nn.Linear(4, 4), nn.Linear(4, 4))
    x = (torch.randn(3, 4), torch.randn(3, 4))
    x[1][0, 0] = float("nan")
    with pytest.raises(petra_ds.NonFiniteError, match="the input of AdditiveCoupling holds NaN values"):
        check_reversible(layer, x)

    class NanInverse(Reversible):
        def forward(self, x):
            return x

        def inverse(self, y):
            return y * torch.nan

    with pytest.raises(ReversibilityError, match=r"NanInverse does not invert: its inverse\(\) returns NaN on the "
                                                 r"finite output of a finite input"):
        check_reversible(NanInverse(), torch.randn(2, 3))


def magnitude_by_definition(tensors) -> float:
    """max |x| over every element, written out: NaN if any element is NaN."""
    flat = torch.cat([t.detach().double().flatten() for t in tensors])
    return float("nan") if bool(flat.isnan().any()) else float(flat.abs().max())


@pytest.mark.parametrize("case", ["negative", "positive", "+inf", "-inf", "nan and inf", "nan and -inf",
                                  "bf16 and a scalar"])
def test_max_abs_each_is_max_abs_over_every_element_of_each_tensor(case):
    """The watch's one scalar per tensor (one fused reduction over all of them) against max |x| written out,
    for the values whose sign or special value the reduction must not lose."""
    from petra_ds.runtime.finite import max_abs_each

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 5, generator=g), torch.randn(300, generator=g)]
    if case == "negative":
        tensors[1][17] = -50.0  # the largest magnitude is a minimum
    elif case == "positive":
        tensors[0][3, 2] = 40.0
    elif case == "+inf":
        tensors[1][5] = float("inf")
    elif case == "-inf":
        tensors[0][0, 0] = -float("inf")
    elif case == "nan and inf":
        tensors[0][1, 1], tensors[1][0] = float("inf"), float("nan")
    elif case == "nan and -inf":  # one tensor: its minimum is -inf, its maximum NaN
        tensors[1][3], tensors[1][200] = -float("inf"), float("nan")
    else:
        tensors = [tensors[0].bfloat16() * -9, torch.tensor(-100.0)]
    got, order = max_abs_each(tensors)
    assert got.dtype == torch.float32 and got.shape == (len(tensors),)
    for value, i in zip(got.tolist(), order or range(len(tensors))):
        want = magnitude_by_definition([tensors[i]])
        assert (math.isnan(value) and math.isnan(want)) or value == want


def mixed_tensors() -> list[torch.Tensor]:
    """Contiguous float32, the two halves of a coupling's output across its channel dimension (not contiguous),
    a bfloat16 one, and float32 again: three groups, each of which CUDA's foreach norm fuses."""
    g = torch.Generator().manual_seed(1)
    pair = torch.randn(4, 6, 3, generator=g).chunk(2, dim=1)
    return [torch.randn(5, generator=g), *pair, torch.randn(3, 2, generator=g).bfloat16(), torch.randn(7, generator=g)]


def test_where_foreach_norm_fuses_only_alike_tensors_max_abs_each_reduces_them_in_groups_and_says_the_order():
    """On CUDA one tensor unlike the rest sends the whole foreach norm to a reduction per tensor: the groups of
    alike tensors are reduced apart, and each entry of the vector says which tensor it is for."""
    from petra_ds.runtime.finite import max_abs_each

    tensors = mixed_tensors()
    got, order = max_abs_each(tensors)
    assert order == [0, 4, 1, 2, 3]  # float32 contiguous, float32 views, bfloat16
    assert got.dtype == torch.float32
    for value, i in zip(got.tolist(), order):
        assert value == magnitude_by_definition([tensors[i]]), i


@pytest.mark.parametrize("bad", [1, 2, 3, 4])
def test_the_first_value_reported_non_finite_is_named_whatever_group_reduced_it(bad):
    """A NaN in any of the tensors, reported in order with an Inf after them: the watch names the first one
    reported, also when the groups put it behind the later one."""
    from petra_ds.runtime.finite import FiniteWatch

    watch = FiniteWatch(lambda: 3, range(1), 1)
    tensors = mixed_tensors()
    tensors[bad][(0,) * tensors[bad].dim()] = float("nan")
    tail = torch.full((2,), float("inf"))
    for i, t in enumerate([*tensors, tail]):
        watch.activation(0, i, t)
    found, value = watch.first()
    assert (found.micro_batch, value) == (bad, "NaN")


class StepWatch(Observer):
    """Stage 1's parameters and optimizer step counts around each of its steps."""

    def __init__(self) -> None:
        self.before, self.after = {}, {}

    @staticmethod
    def _state(engine):
        optimizer = engine.stage_optimizers[1]
        counts = [float(optimizer.state[p]["step"]) for p in engine.stages[1].params if "step" in optimizer.state[p]]
        return [p.detach().clone() for p in engine.stages[1].params], counts

    def before_step(self, engine, stage, step):
        if stage == 1:
            self.before[step] = self._state(engine)

    def after_step(self, engine, stage, step):
        if stage == 1:
            self.after[step] = self._state(engine)


@pytest.mark.parametrize("optimizer", [{"type": "SGD", "params": {"lr": 0.01, "fused": True}},
                                       {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True, "fused": True}},
                                       {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}}])
def test_a_step_with_a_non_finite_gradient_is_skipped_and_named_after_the_window(world_of_one, optimizer):
    """Under "skip" a NaN gradient's step is skipped: on the device by a fused optimizer (``found_inf``, no host
    read), by a host read otherwise; the window's read names it. Stage 1's parameters and its optimizer's step
    counts are exactly as before that step; its other steps move them."""
    from petra_ds.runtime.finite import skips_on_device

    engine = engine_with(LayerSpec(Poison, "output"), petra={"non_finite": "skip"}, optimizer=optimizer)
    assert skips_on_device(engine.stage_optimizers[1]) == bool(optimizer["params"].get("fused"))
    watch = engine.observe(StepWatch())
    train(engine, data())
    skipped = [step for stage, step in engine.skipped_steps if stage == 1]
    assert skipped == [(MARKED // K) + 1], engine.skipped_steps
    for step, (params, counts) in watch.after.items():
        moved = not all(torch.equal(a, b) for a, b in zip(watch.before[step][0], params))
        assert moved == (step not in skipped), step
        if watch.before[step][1]:  # the optimizer's state exists from its first step on
            assert counts == [c + (step not in skipped) for c in watch.before[step][1]]
    assert all(bool(p.isfinite().all()) for p in engine.module.parameters())

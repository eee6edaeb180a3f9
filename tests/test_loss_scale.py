"""``"fp16"`` with PETRA: one loss scale per stage (``runtime/loss_scale.py``).

The oracles: DeepSpeed's own ``DynamicLossScaler`` for the scale's rule; the same run at another power-of-two scale
(scaling is exact, so the bits must not move); fp32 for what fp16 rounds; and the uninterrupted run for a resumed one.
"""

import copy
import itertools
import math
import random

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from torch import nn

import petra_ds
from harness import launch, merged_params
from petra_ds.nn.check import NonFiniteError
from petra_ds.runtime.config import PetraConfigError, split_config
from petra_ds.runtime.loss_scale import LossScaleConfig, StageLossScale
from petra_ds.tools.toy import toy_data, toy_layer_specs

SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def fp16(**keys) -> dict:
    return {"config": {"fp16": {"enabled": True, **keys}}}


# --- the scale's rule, against DeepSpeed's DynamicLossScaler ---

@pytest.mark.parametrize("hysteresis,consecutive,window,power,min_scale", [
    (1, False, 1, 8, 1), (2, False, 3, 6, 4), (3, True, 2, 10, 1), (2, True, 4, 5, 8), (1, True, 5, 12, 2)])
def test_the_scale_follows_deepspeeds_dynamic_loss_scaler(world_of_one, hysteresis, consecutive, window, power,
                                                          min_scale):
    """The same overflow sequence through both: the same scale after every step, and an overflow at the minimum
    scale is unhandled exactly where DeepSpeed's scaler (raise_error_at_min_scale) raises."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    config = LossScaleConfig(initial_scale_power=power, loss_scale_window=window, hysteresis=hysteresis,
                             consecutive_hysteresis=consecutive, min_loss_scale=float(min_scale))
    ours = StageLossScale(config, "cpu")
    theirs = DynamicLossScaler(init_scale=2.0 ** power, scale_window=window, min_scale=min_scale,
                               delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                               raise_error_at_min_scale=False)
    rng, unhandled_seen, grew = random.Random(power), 0, 0
    for i in range(400):
        overflow = rng.random() < (0.9 if i // 50 % 2 else 0.1)  # bursts that reach the minimum, calm that grows
        strict = copy.deepcopy(theirs)
        strict.raise_error_at_min_scale = True
        try:
            strict.update_scale(overflow)
            raises = False
        except Exception:
            raises = True
        before = theirs.cur_scale
        theirs.update_scale(overflow)
        grew += theirs.cur_scale > before
        unhandled = ours.update(torch.tensor(float(overflow)))
        assert bool(unhandled) == raises
        unhandled_seen += raises
        assert ours.value() == theirs.cur_scale
        assert float(ours.inverse) == 1 / theirs.cur_scale
    assert unhandled_seen and grew  # both branches ran


def test_a_fixed_scale_never_moves():
    ours = StageLossScale(LossScaleConfig(loss_scale=128.0), "cpu")
    assert ours.update(torch.tensor(1.0)) is None and ours.value() == 128.0


# --- training ---

def test_power_of_two_scales_train_the_same_bits_and_fp16_rounds_less_than_bf16():
    """Two ranks of 2 stages: fixed scales 4 and 1024 and the dynamic default (2^16, no overflow on this model) give
    the same losses and weights bit for bit, as one process hosting all 4 stages does; every one differs from fp32
    (fp16 ran), by less than bf16 does."""
    common = {"k": 2, "micro_batch": 4, "train_batches": 4, "dropout": 0.1, "optimizer": SGD, "dtype": "float32"}
    runs = {name: launch({"pipe": pipe, "stages_per_rank": 4 // pipe, **common, **extra}) for name, pipe, extra in [
        ("fp32", 2, {}), ("bf16", 2, {"bf16": True}), ("fp16 x4", 2, fp16(loss_scale=4)),
        ("fp16 x1024", 2, fp16(loss_scale=1024)), ("fp16 dynamic", 2, fp16()), ("fp16 one process", 1, fp16())]}
    params = {name: merged_params(res) for name, res in runs.items()}
    want = params["fp16 dynamic"]
    for name in ("fp16 x4", "fp16 x1024", "fp16 one process"):
        assert params[name].keys() == want.keys()
        assert all(torch.equal(params[name][n], want[n]) for n in want), name
        losses, want_losses = (torch.tensor(runs[n][-1]["losses"]) for n in (name, "fp16 dynamic"))
        torch.testing.assert_close(losses, want_losses, rtol=0, atol=0, equal_nan=True)
    assert not any(res["skipped_steps"] for res in runs["fp16 dynamic"])

    def distance(name: str) -> float:
        return max(float((params[name][n] - params["fp32"][n]).abs().max()) for n in want)

    assert 0 < distance("fp16 dynamic") < distance("bf16")


FP16_TOL = 2e-2  # fp16's u = 2^-11 in place of bf16's 2^-9 in tests/test_gpu.py's bound (sqrt(18) x 4 x u ~ 8e-3)


@pytest.mark.parametrize("lr", [0.0, 0.1])
def test_fp16_matches_the_float64_oracle(lr):
    """J = 3, stage 1 reconstructing, dynamic scaling: with lr 0 every step's gradients (unscaled, as the step sees
    them) are plain float64 autograd's, and with SGD the weights after 4 steps are PETRA's clock replayed in float64,
    both within fp16's rounding; an error above fp32's shows the layers ran in fp16."""
    import oracle
    from harness import model_for

    spec = {"pipe": 1, "stages_per_rank": 3, "k": 2, "train_batches": 4, "dtype": "float32", "dropout": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}},
            "config": {"fp16": {"enabled": True}, "gradient_clipping": 0}}
    got = launch(spec)[0]
    assert got["reconstructs"][1] and not got["skipped_steps"]
    initial = got["params"] if lr == 0 else launch({**spec, "train_batches": 0, "drain": False})[0]["params"]
    layer_specs, loss_fn, data_fn = model_for(spec)
    data = [(x.double(), y) for x, y in data_fn(8, 4, 0, torch.float32)]
    stages = oracle.build_stages(3, dropout=0.0, specs=layer_specs)
    with torch.no_grad():
        for stage in stages:
            for n, p in oracle.named_params(stage).items():
                p.copy_(initial[n].double())
    if lr == 0:
        errors = []
        for step in range(4):
            ref = oracle.autograd_group_grads(stages, data, range(step * 2, step * 2 + 2), 0, loss=loss_fn)
            for j in range(3):
                scale = max(r.abs().max().item() for r in ref[j].values())
                errors.append(max((got["grads"][j][step][n].double() - ref[j][n]).abs().max().item()
                                  for n in ref[j]) / scale)
        error = max(errors)
    else:
        start = {n: p.detach().clone() for s in stages for n, p in oracle.named_params(s).items()}
        final, _ = oracle.delayed_training(stages, data, 2, lr, 0.9, 0)
        moved = max((final[n] - start[n]).abs().max().item() for n in final)
        error = max((got["params"][n].double() - final[n]).abs().max().item() for n in final) / moved
    assert 1e-5 < error < FP16_TOL, error


def lower_first_ranks_scales(engine) -> None:
    """(a harness ``setup``) stages 0 and 1 start at scale 2^12, the others where the config put them."""
    for j, stage in engine.stages.items():
        if j < 2:
            stage.loss_scale.load_state_dict({**stage.loss_scale.state_dict(), "scale": 2.0 ** 12})


def test_tied_embeddings_cross_ranks_unscaled():
    """RevGPT with its embedding (stage 0) tied to its head (stage 3), on 2 ranks, stages 0-1 at scale 2^12 and 2-3
    at 2^16: the head's gradient reaches the embedding after its own stage unscaled it, so the run ends where all
    stages at 2^16 end, within fp16's subnormal rounding (a few 1e-9 here: RevGPT's smallest gradients, the key
    bias's above all, fall below fp16's normal range); a gradient added at its sender's scale would be 16 times
    too large."""
    common = {"pipe": 2, "stages_per_rank": 2, "k": 2, "train_batches": 3, "model": "revgpt", "tie_embeddings": True,
              "dropout": 0.0, "optimizer": SGD, "dtype": "float32", **fp16(loss_scale=2 ** 16)}
    start = merged_params(launch({**common, "train_batches": 0, "drain": False}))
    lowered = {"setup": "test_loss_scale:lower_first_ranks_scales"}
    runs = [merged_params(launch({**common, **setup})) for setup in ({}, lowered)]
    assert runs[0].keys() == runs[1].keys() == start.keys()
    assert float((runs[1]["0.token.weight"] - start["0.token.weight"]).abs().max()) > 1e-4  # it trained
    for n in runs[1]:
        torch.testing.assert_close(runs[1][n], runs[0][n], rtol=0, atol=1e-7)


def tiny_loss_engine(precision: dict, calls: int = 1):
    """The toy model (3 stages, one process) whose loss is 2^-24 of its cross-entropy: the first step's gradients of
    each stage, as the step uses them (unscaled), and the engine."""
    torch.manual_seed(0)
    model = petra_ds.PetraPipelineModule(
        toy_layer_specs(), topology=PipeDataParallelTopology(num_pp=1, num_dp=1), stages_per_rank=3,
        loss_fn=lambda out, labels: nn.functional.cross_entropy(out, labels) * 2.0 ** -24,
        partition_method="uniform", base_seed=0)
    config = {**BASE, "steps_per_print": 10**9, "gradient_clipping": 0, **precision, "petra": {"stages_per_rank": 3}}
    engine, *_ = petra_ds.initialize(model=model, config=config)
    grads: dict[int, list[torch.Tensor]] = {}
    engine.step_observers.append(lambda j, st: grads.setdefault(j, [p.grad.clone() for p in st.params]))
    data = itertools.cycle(toy_data(16, 4, dtype=torch.float32))
    for _ in range(calls):
        engine.train_batch(data)
    return grads, engine


def test_a_tiny_loss_underflows_in_fp16_at_scale_one_and_is_kept_by_the_dynamic_scale(world_of_one):
    """Gradients of order 1e-9 and below are lost to fp16 (its smallest subnormal is 6e-8) unless the loss is scaled;
    fp32 is the reference for what the step should see."""
    want, _ = tiny_loss_engine({}, calls=3)
    for precision, bound in [({"fp16": {"enabled": True, "loss_scale": 1}}, None),
                             ({"fp16": {"enabled": True}}, 1e-2)]:
        got, engine = tiny_loss_engine(precision, calls=3)
        assert sorted(got) == sorted(want) == [0, 1, 2]
        errors = [float(torch.linalg.vector_norm(torch.cat([(g - w).flatten() for g, w in zip(got[j], want[j])]))
                        / torch.linalg.vector_norm(torch.cat([w.flatten() for w in want[j]]))) for j in want]
        if bound is None:
            assert max(errors) > 0.5, errors  # most of it underflowed
        else:
            assert max(errors) < bound, errors
            assert not engine.skipped_steps


def overflow_engine(world_of_one, precision: dict, calls: int, optimizer: dict | None = None,
                    scheduler: dict | None = None):
    torch.manual_seed(0)
    model = petra_ds.PetraPipelineModule(
        toy_layer_specs(), topology=PipeDataParallelTopology(num_pp=1, num_dp=1), stages_per_rank=3,
        loss_fn=nn.CrossEntropyLoss(), partition_method="uniform", base_seed=0)
    config = {**BASE, "steps_per_print": 10**9, "gradient_clipping": 1.0, **precision,
              "petra": {"stages_per_rank": 3, **precision.pop("petra", {})},
              "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "fused": True}},
              **({} if scheduler is None else {"scheduler": scheduler})}
    engine, *_ = petra_ds.initialize(model=model, config=config)
    before: dict[int, list[list[torch.Tensor]]] = {j: [] for j in engine.stages}
    engine.step_observers.append(lambda j, st: before[j].append([p.detach().clone() for p in st.params]))
    data = itertools.cycle(toy_data(16, 4, dtype=torch.float32))
    return engine, before, [engine.train_batch(data) for _ in range(calls)]


def test_an_overflowing_scale_skips_its_steps_halves_and_trains_on(world_of_one):
    """From 2^30 the gradients overflow fp16: each stage's first steps are skipped, and exactly its skipped steps leave
    its weights where they were; its scale halves at each (hysteresis 1; the window, 1000, never doubles it); the
    skips are counted, not raised, and training goes on."""
    engine, before, losses = overflow_engine(world_of_one, {"fp16": {"enabled": True, "initial_scale_power": 30,
                                                                     "hysteresis": 1}}, calls=24)
    skipped = engine.skipped_steps
    assert skipped and math.isfinite(float(losses[-1]))
    for j, snapshots in before.items():
        steps = [s for stage, s in skipped if stage == j]
        assert steps[:3] == [1, 2, 3] and len(steps) < len(snapshots) - 1, (j, skipped)
        for s in range(1, len(snapshots)):  # snapshots[s - 1] was taken before step s
            unchanged = all(map(torch.equal, snapshots[s - 1], snapshots[s]))
            assert unchanged == (s in steps), (j, s)
        assert engine.stages.loss_scales()[j] == 2.0 ** (30 - len(steps))


def test_a_skipped_step_still_advances_its_stages_lr_schedule(world_of_one):
    """The host learns of an overflow at the window's end, so a stage's scheduler steps with every step the schedule
    gives it, skipped or not (DeepSpeed's engine, which reads its one overflow flag at each step, does not step it):
    each stage's learning rate is DeepSpeed's WarmupLR after all of that stage's steps, whatever it skipped."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    schedule = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 50, "warmup_type": "linear"}
    engine, before, _ = overflow_engine(world_of_one, {"fp16": {"enabled": True, "initial_scale_power": 30,
                                                                "hysteresis": 1}}, calls=8,
                                        scheduler={"type": "WarmupLR", "params": schedule})
    assert engine.skipped_steps
    for j, scheduler in enumerate(engine.stage_schedulers):
        oracle = WarmupLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-2), **schedule)
        for _ in before[j]:
            oracle.step()
        assert scheduler.get_last_lr() == oracle.get_last_lr(), (j, len(before[j]), engine.skipped_steps)


def test_a_fused_sgd_whose_first_steps_overflow_trains_as_the_unfused_one(world_of_one):
    """torch's fused SGD makes its momentum buffers with empty_like at its first step, and a step it skips on the
    device leaves them so: fp16's early overflows then fed uninitialised memory to the next step (NaN weights). That
    step is guarded on the host instead: the fused run ends where the unfused one does, up to their rounding."""
    precision = {"fp16": {"enabled": True, "initial_scale_power": 22, "hysteresis": 1}}
    runs = [overflow_engine(world_of_one, dict(precision), calls=10,
                            optimizer={"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "fused": fused}})
            for fused in (False, True)]
    (plain, _, plain_losses), (fused, _, fused_losses) = runs
    assert plain.skipped_steps and fused.skipped_steps == plain.skipped_steps
    assert all(math.isfinite(float(loss)) for loss in fused_losses[1:])
    for a, b in zip(plain.module.parameters(), fused.module.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_scaling_and_its_skips_read_nothing_on_the_host(world_of_one):
    """Scales that move (overflows from 2^30) with a fused optimizer, which skips on the device: a steady-state
    train_batch still reads the host once, the window's one transfer."""
    from petra_ds.util.host_reads import HostSyncs

    engine, _, _ = overflow_engine(world_of_one, {"fp16": {"enabled": True, "initial_scale_power": 30,
                                                           "hysteresis": 1}}, calls=3)
    data = itertools.cycle(toy_data(16, 4, dtype=torch.float32))
    with HostSyncs() as syncs:
        engine.train_batch(data)
    assert syncs.count == 1, dict(syncs.where)
    assert engine.skipped_steps


@pytest.mark.parametrize("non_finite", ["raise", "skip"])
def test_an_overflow_at_the_minimum_scale_is_named(world_of_one, deepspeed_warnings, non_finite):
    """min_loss_scale 2^20 on this model overflows at every scale: once at the minimum, the overflow is a non-finite
    gradient, raised by name under "raise", logged under "skip"."""
    precision = {"fp16": {"enabled": True, "initial_scale_power": 22, "hysteresis": 1, "min_loss_scale": 2 ** 20},
                 "petra": {"non_finite": non_finite}}
    if non_finite == "raise":
        with pytest.raises(NonFiniteError, match=r"non-finite gradient at stage 2.*min_loss_scale") as caught:
            overflow_engine(world_of_one, precision, calls=12)
        assert caught.value.stage == 2
        return
    engine, _, _ = overflow_engine(world_of_one, precision, calls=12)
    assert engine.stages.loss_scales() == {0: 2.0 ** 20, 1: 2.0 ** 20, 2: 2.0 ** 20}
    assert any("min_loss_scale" in m for m in deepspeed_warnings)


def test_a_resumed_fp16_run_continues_each_stages_scale(tmp_path):
    """Scales that moved (overflows from 2^24, hysteresis 1) are in the checkpoint: fresh processes that load it end
    where the uninterrupted run ends, bit for bit; a run that forgot them would skip other steps."""
    common = {"pipe": 2, "stages_per_rank": 2, "k": 2, "train_batches": 8, "dropout": 0.1, "optimizer": SGD,
              "dtype": "float32", **fp16(initial_scale_power=24, hysteresis=1)}
    whole = launch(common)
    assert whole[0]["skipped_steps"] or whole[1]["skipped_steps"]
    ckpt = str(tmp_path / "ckpt")
    first = launch({**common, "save_dir": ckpt, "save_after": 4})
    assert [r["params"] for r in first] and merged_params(first).keys() == merged_params(whole).keys()
    resumed = launch({**common, "load_dir": ckpt}, fresh=True)
    want, got = merged_params(whole), merged_params(resumed)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_nan_in_the_data_is_still_named_where_it_began():
    """Dynamic scaling takes gradient overflows off the NaN watch, nothing else: a NaN feature in micro-batch 3 is
    the micro-batch's error, at stage 0, as in fp32."""
    res = launch({"pipe": 1, "stages_per_rank": 4, "k": 2, "train_batches": 4, "nan_micro_batch": 3,
                  "capture_grads": False, "dtype": "float32", "return_error": True, **fp16()})[0]
    assert res["error"].startswith("NonFiniteError: non-finite micro-batch at stage 0, micro-batch 3, clock 3: NaN")


def test_data_parallel_replicas_move_their_scales_together():
    """2 replicas of 4 stages whose scales move (overflows from 2^24): each step's overflow is judged after the
    average, so both skip the same steps and end with the same weights, bit for bit."""
    res = launch({"pipe": 1, "dp": 2, "stages_per_rank": 4, "k": 2, "train_batches": 6, "optimizer": SGD,
                  "dtype": "float32", **fp16(initial_scale_power=24, hysteresis=1)})
    assert res[0]["skipped_steps"] and res[0]["skipped_steps"] == res[1]["skipped_steps"]
    assert all(torch.equal(res[0]["params"][n], res[1]["params"][n]) for n in res[0]["params"])


# --- the config ---

def test_fp16_is_parsed_by_deepspeeds_model_and_taken_out_of_deepspeeds_hands():
    petra, ds, precision = split_config({**BASE, "fp16": {"enabled": True, "loss_scale_window": 50, "hysteresis": 1}})
    assert "fp16" not in ds and precision.autocast == torch.float16 and precision.name == "fp16"
    assert precision.loss_scale == LossScaleConfig(loss_scale_window=50, hysteresis=1)
    assert "window 50, hysteresis 1" in precision.describe()
    assert split_config({**BASE, "bf16": {"enabled": True}})[2].name == "bf16"
    assert split_config(BASE)[2].describe() == "fp32"


@pytest.mark.parametrize("extra,message", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r'"bf16" and "fp16" are both enabled'),
    ({"fp16": {"enabled": True, "auto_cast": True}}, r'"fp16.auto_cast" casts the inputs'),
    ({"fp16": {"enabled": True, "loss_scale": 100}}, r"must be powers of two .*loss_scale 100"),
    ({"fp16": {"enabled": True, "min_loss_scale": 3}}, r"must be powers of two"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, r'the "fp16" section: .*loss_scale_window must be > 0'),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, r'"fp16.hysteresis" must be at least 1'),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, r"ZeRO-Offload setting"),
])
def test_an_fp16_section_petra_cannot_run_is_refused_by_name(extra, message):
    with pytest.raises(PetraConfigError, match=message):
        split_config({**BASE, **extra})

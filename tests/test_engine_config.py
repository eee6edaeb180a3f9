"""Optimizers, schedulers and parameter groups from the DeepSpeed config, one set per stage; bf16;
shape changes; layer files a plain PipelineModule reads."""

import re
import time

import pytest

from petra_ds.runtime.messages import MessageLayoutError

from harness import launch


def run_probe(**spec):
    results = launch({"pipe": 1, "stages_per_rank": 4, "probe": "probes:optimizers", **spec})
    return results[0]


@pytest.mark.parametrize("opt,cls", [
    ({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}}, "SGD"),
    ({"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}}, "Adam"),
    ({"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}, "AdamW"),
])
def test_optimizer_per_stage_from_config(opt, cls):
    res = run_probe(optimizer=opt, train_batches=2, drain=False)
    probe = res["probe"]
    assert sorted(probe) == [0, 1, 2, 3]
    classes = {p["class"] for p in probe.values()}
    assert len(classes) == 1
    assert classes == {cls}  # torch's classes: "torch_adam" spares the CPU a JIT build of FusedAdam
    if cls == "SGD":
        assert all(p["groups"][0]["nesterov"] for p in probe.values())
    for p in probe.values():
        assert p["groups"][0]["lr"] == opt["params"]["lr"]


def test_param_groups_split_per_stage_and_keep_their_options():
    res = run_probe(optimizer={"type": "SGD", "params": {"lr": 0.05, "weight_decay": 5e-4}},
                    no_decay_on_bias=True, train_batches=1, drain=False)
    for p in res["probe"].values():
        assert [g["weight_decay"] for g in p["groups"]] == [5e-4, 0.0]
        assert p["group_sizes"][0] == p["group_sizes"][1] > 0  # every Linear has a weight and a bias


def test_each_stage_steps_its_own_scheduler():
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 8,
                                            "warmup_type": "linear"}}
    res = run_probe(optimizer={"type": "SGD", "params": {"lr": 0.1}}, config={"scheduler": sched},
                    k=1, train_batches=5, drain=False)
    probe = res["probe"]
    steps = {j: p["stage_steps"] for j, p in probe.items()}
    # after clocks 0..4 with J = 4, stage j ran the backwards of m <= 4 - 2(3 - j): they step apart
    assert steps == {0: 0, 1: 0, 2: 1, 3: 2}
    for j, p in probe.items():
        assert p["scheduler_steps"] == steps[j]
    # DeepSpeed's linear WarmupLR gives lr = 0.1 * (steps - 1) / 8
    assert probe[3]["lr"] == pytest.approx(0.1 / 8) and probe[2]["lr"] == probe[1]["lr"] == 0.0


def test_client_optimizer_and_scheduler_callables_are_built_per_stage():
    res = run_probe(client_optimizer={"lr": 0.08, "gamma": 0.5}, k=1, train_batches=5, drain=False)
    for j, p in res["probe"].items():
        assert p["class"] == "SGD"
        assert p["scheduler_steps"] == p["stage_steps"]
        assert p["lr"] == pytest.approx(0.08 * 0.5 ** p["stage_steps"]), j
    assert res["probe"][3]["stage_steps"] == 2 and res["probe"][0]["stage_steps"] == 0


@pytest.mark.slow  # ~21 s; the default run keeps test_transformer's bf16 reconstruction bound through 12 blocks
def test_bf16_on_cpu_trains_and_bounds_the_reconstruction_error():
    """bf16 autocast in F and G with fp32 parameters and fp32 streams (docs/guides/gpus.md)."""
    common = {"k": 2, "dtype": "float32", "micro_batch": 16, "dropout": 0.1}
    frozen = {"optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "train_batches": 6, "track_reconstruction": True}
    errors = {}
    for bf16 in (False, True):
        res = launch({"pipe": 1, "stages_per_rank": 4, **common, **frozen, "bf16": bf16})[0]
        errors[bf16] = res["reconstruction_errors"][1]
        assert len(errors[bf16]) == 12
    # the documented bound: relative max error per reversible stage, the same with bf16 autocast as in
    # fp32 because the reconstruction runs F and G under the same autocast as the forward
    assert max(errors[False]) < 1e-5
    assert max(errors[True]) < 1e-5
    trained = launch({"pipe": 1, "stages_per_rank": 4, **common, "bf16": True, "train_batches": 60,
                      "distinct_micro_batches": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
                      "capture_grads": False, "dropout": 0.0})[0]
    losses = trained["losses"]
    first, last = sum(losses[1:11]) / 10, sum(losses[-11:-1]) / 10
    assert last < 0.7 * first, (first, last)


def test_a_micro_batch_of_another_shape_stops_every_rank_with_a_clear_error():
    start = time.time()
    with pytest.raises(RuntimeError) as info:
        launch({"pipe": 2, "stages_per_rank": 1, "k": 2, "train_batches": 5, "bad_micro_batch": 5}, timeout=120)
    assert time.time() - start < 120
    message = str(info.value)
    assert MessageLayoutError.__name__ in message
    assert "micro-batch 5 has layout (float64[3, 6], int64[3]) but the first one had (float64[4, 6], int64[4])" in message
    assert "drop_last=True" in message


@pytest.mark.parametrize("policy", ["backward", "forward"])
def test_batch_norm_running_stats_are_updated_where_the_policy_says(policy):
    """Paper 4.1: by default only the backward recomputation / reconstruction updates them (the last
    stage's single evaluation is its backward); "forward" is the ablation."""
    res = launch({"pipe": 1, "stages_per_rank": 4, "k": 2, "train_batches": 3, "drain": False, "batchnorm": True,
                  "petra": {"bn_running_stats": policy}, "probe": "probes:batch_norm_updates"})[0]
    probe = res["probe"]
    for j, entry in probe.items():
        if not entry["tracked"]:
            continue
        if policy == "backward" or j == 3:
            expected = entry["backwards"]
        else:
            expected = entry["forwards"]
        assert set(entry["tracked"]) == {expected}, (j, entry)
    assert probe[1]["forwards"] > probe[1]["backwards"] > 0, "the check needs micro-batches in flight"


def test_a_layer_declared_reversible_with_a_wrong_inverse_is_refused_at_the_first_forward():
    (result,) = launch({"pipe": 1, "stages_per_rank": 4, "k": 2, "train_batches": 1, "wrong_inverse_at": 4,
                        "return_error": True}, timeout=120)
    message = result["error"]
    assert message.startswith("ReversibilityError: ") and "stage 1, its layer 1 (WrongInverse) does not invert" in message
    assert "fix its inverse() or declare it non-reversible" in message


@pytest.mark.parametrize("policy, check_finite", [("raise", True), ("raise", False), ("skip", True)])
def test_non_finite_policy(policy, check_finite):
    """A NaN in micro-batch 3 (window 1, k = 2): "raise" names the micro-batch where stage 0 read it, or with
    "check_finite" off the loss at stage 3, with its micro-batch and clock; "skip" skips every stage's update
    of that window only, and no parameter is ever NaN."""
    spec = {"pipe": 1, "stages_per_rank": 4, "k": 2, "train_batches": 4, "nan_micro_batch": 3,
            "petra": {"non_finite": policy, "check_finite": check_finite}, "capture_grads": False}
    if policy == "raise":
        expected = (r"NonFiniteError: non-finite micro-batch at stage 0, micro-batch 3, clock 3: NaN in its inputs"
                    if check_finite else r"NonFiniteError: non-finite loss at stage 3, micro-batch 3, clock 6: NaN")
        (result,) = launch({**spec, "return_error": True}, timeout=120)
        assert re.match(expected, result["error"]), result["error"]
        return
    (result,) = launch(spec, timeout=120)
    assert sorted(result["skipped_steps"]) == [(j, 2) for j in range(4)]
    assert all(bool(v.isfinite().all()) for v in result["params"].values())
    assert result["stage_steps"] == {j: 4 for j in range(4)}
    finite = [loss for loss in result["losses"] if loss == loss]
    assert len(finite) >= 3 and finite[-1] < 5


@pytest.mark.parametrize("k, warned", [(2, True), (6, False)])
def test_rank0_warns_when_stage0_is_more_than_one_step_behind(world_of_one, k, warned):
    """J = 4: stage 0 is 6 / k optimizer steps behind; the warning names the k that fixes it."""
    import logging

    from deepspeed.utils import logger

    from test_gradient_quality import _engine

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        _engine(J=4, k=k)
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records if "optimizer steps after its forward" in r.getMessage()]
    assert bool(messages) == warned
    if warned:
        assert "3 optimizer steps" in messages[0] and '"gradient_accumulation_steps": 6' in messages[0]


def test_eval_batch_gives_each_micro_batch_loss_or_their_mean_and_refuses_other_reductions(world_of_one):
    """``reduce_output=None`` as DeepSpeed's PipelineEngine has it: the micro-batches' losses, whose mean is what
    ``"avg"`` returns; anything else is named."""
    import torch
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    from torch import nn

    import petra_ds
    from petra_ds.tools.toy import toy_data, toy_layer_specs

    model = petra_ds.PetraPipelineModule(toy_layer_specs(), topology=PipeDataParallelTopology(num_pp=1, num_dp=1),
                                         loss_fn=nn.CrossEntropyLoss(), stages_per_rank=3, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "petra": {"stages_per_rank": 3}}
    engine, *_ = petra_ds.initialize(model=model, config=config)
    batches = toy_data(3, 4, dtype=torch.float32)
    each = engine.eval_batch(iter(batches), reduce_output=None)
    assert len(each) == 3 and all(t.numel() == 1 for t in each)
    assert torch.allclose(torch.stack(each).mean(), engine.eval_batch(iter(batches)))
    assert len({round(t.item(), 6) for t in each}) == 3
    with pytest.raises(ValueError, match="reduce_output='sum'"):
        engine.eval_batch(iter(batches), reduce_output="sum")


def test_every_clock_tells_forwards_done_before_clock_end_fill_and_drain_included():
    """The observers' documented order, on every rank of a 3-rank pipeline, once per clock: forwards_done, then
    clock_end; also in the clocks where a rank runs no backward (the fill) or nothing at all (fill and drain)."""
    results = launch({"pipe": 3, "stages_per_rank": 1, "k": 2, "train_batches": 2, "drain": True,
                      "capture_grads": False, "hook_order": True})
    for r in results:
        assert r["hook_order"] == [(hook, c) for c in range(r["clock"]) for hook in ("forwards_done", "clock_end")]

"""What the run does, said at start-up (``engine.run_settings``, printed by rank 0): read from the engine
DeepSpeed built, not from the config, so a default DeepSpeed fills in (gradient clipping at 1.0) is shown
with where it came from."""

import pytest
from torch import nn

import petra_ds
from petra_ds.diagnostics.settings import format_settings


def toy_engine(config_extra: dict, petra: bool = True, compensation="weight_prediction"):
    from deepspeed.pipe import PipelineModule

    from petra_ds.tools.toy import toy_layer_specs

    layers = toy_layer_specs(dropout=0.0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, **config_extra}
    if petra:
        config["petra"] = {"stages_per_rank": 3, "delay_compensation": compensation, **config_extra.get("petra", {})}
        model = petra_ds.PetraPipelineModule(layers, num_stages=1, loss_fn=nn.CrossEntropyLoss(),
                                             stages_per_rank=3, partition_method="uniform")
    else:
        model = PipelineModule(layers, num_stages=1, loss_fn=nn.CrossEntropyLoss(), partition_method="uniform")
    engine, *_ = petra_ds.initialize(model=model, config=config)
    return engine


@pytest.mark.parametrize("config, max_norm, source", [
    ({}, 1.0, "DeepSpeed"), ({"gradient_clipping": 0.0}, 0.0, "config"), ({"gradient_clipping": 0.5}, 0.5, "config")])
def test_clipping_is_reported_with_where_its_value_came_from(world_of_one, config, max_norm, source, capsys):
    engine = toy_engine(config)
    clip = engine.run_settings["gradient_clipping"]
    assert clip["max_norm"] == max_norm == engine.gradient_clipping()
    assert clip["from"].startswith(source)
    printed = capsys.readouterr().out
    if max_norm:
        assert f"gradient clipping: norm {max_norm:g} over each stage's own parameters, from {clip['from']}" in printed
        assert ('"gradient_clipping": 0' in printed) == (source == "DeepSpeed")
    else:
        assert "gradient clipping: off, from config" in printed


def test_every_stage_optimizer_schedule_layout_and_compensation(world_of_one, capsys):
    engine = toy_engine({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}})
    s = engine.run_settings
    assert s["method"] == "petra" and s["stages"] == 3 and s["stages_per_rank"] == 3
    assert s["micro_batches_per_step"] == 2 and s["micro_batch_size"] == 4
    assert [st["stage"] for st in s["per_stage"]] == [0, 1, 2]
    parts = engine.module.petra_parts
    assert [st["layers"] for st in s["per_stage"]] == [parts[j:j + 2] for j in range(3)]
    for st, opt in zip(s["per_stage"], engine.stage_optimizers, strict=True):
        assert st["optimizer"] == type(opt).__name__ == "SGD"
        assert [g["lr"] for g in st["param_groups"]] == [g["lr"] for g in opt.param_groups]
        assert all(g["momentum"] == 0.9 for g in st["param_groups"])
        assert st["lr_schedule"] == "WarmupLR"
    assert s["delay_compensation"]["method"] == "weight_prediction"
    printed = capsys.readouterr().out
    assert "method: petra (PetraEngine)" in printed and "stages 0-2: SGD (lr " in printed
    assert "delay compensation: weight_prediction" in printed
    assert s["synchronous_steps"] == 0 and "synchronous steps" not in printed


def test_synchronous_steps_are_said_with_their_cost_in_clocks(world_of_one, capsys):
    engine = toy_engine({"petra": {"synchronous_steps": 5}})
    assert engine.run_settings["synchronous_steps"] == 5
    assert "synchronous steps: the first 5 train_batch calls drain (no delay, compensation waits; 4 more clocks " \
        "each)" in capsys.readouterr().out


def test_the_1f1b_baseline_says_it_trains_backprop(world_of_one, capsys):
    engine = toy_engine({}, petra=False)
    s = engine.run_settings
    assert s["method"] == "backprop" and s["engine"] == "PipelineEngine" and s["delay_compensation"] is None
    assert s["gradient_clipping"]["scope"] == "all parameters (one norm)"
    printed = capsys.readouterr().out
    assert "method: backprop (PipelineEngine)" in printed and printed.count(format_settings(s)) == 1


def test_a_schedulers_construction_warning_is_said_once_not_once_per_stage(world_of_one):
    """DeepSpeed's WarmupCosineLR warns from its constructor; a DeepSpeed engine builds one, PETRA's three
    stages three."""
    import logging

    from deepspeed.utils import logger

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        toy_engine({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}})
    finally:
        logger.removeHandler(handler)
    started = [r for r in records if "before it has started" in r.getMessage()]
    assert len(started) == 1, [r.getMessage() for r in records]


@pytest.mark.parametrize("compensation, printed", [
    ("none", "none"), ({"method": "weight_prediction", "beta": 0.5}, "weight_prediction (beta 0.5)"),
    (["weight_prediction", {"method": "adaptive_momentum", "beta1_max": 0.95}],
     "weight_prediction + adaptive_momentum (beta1_max 0.95)")])
def test_the_delay_compensation_is_said_with_the_parameters_that_differ(world_of_one, compensation, printed, capsys):
    engine = toy_engine({}, compensation=compensation)
    assert f"delay compensation: {printed}\n" in capsys.readouterr().out
    methods = engine.run_settings["delay_compensation"]
    methods = methods if isinstance(methods, list) else [methods]
    assert [m["method"] for m in methods] == [p.split(" ")[0] for p in printed.split(" + ")]

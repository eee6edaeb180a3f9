"""Every setting PETRA cannot run is refused up front, with a message that names it and says what to do.

The config checks are pure; the model and ``petra_ds.initialize`` checks run in this process as a
one-process torch.distributed world (no launcher), so each takes milliseconds.
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from deepspeed import comm as ds_comm
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from hypothesis import given, settings, strategies as st
from torch import nn

import petra_ds
from petra_ds.runtime.config import (BN_RUNNING_STATS, INPUT_BUFFERS, NON_FINITE, PetraConfig, PetraConfigError,
                                     split_config)
from petra_ds.runtime.messages import MessageLayoutError
from petra_ds.schedule import kept_first
from petra_ds.tools.toy import toy_data, toy_layer_specs

BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
LAYERS = len(toy_layer_specs())


# --- the DeepSpeed config around the "petra" section (tests/test_config.py has the first cases) ---------


@pytest.mark.parametrize("extra,message", [
    ({"petra": True}, r'the "petra" config section must be an object .* got True; use "petra": \{\}'),
    ({"petra": ["stages_per_rank", 2]}, r'the "petra" config section must be an object'),
    ({"gradient_accumulation_steps": "2"}, r"\"gradient_accumulation_steps\" \(PETRA's k\) must be an integer >= 1, got '2'"),
    ({"gradient_accumulation_steps": 2.0}, r"\(PETRA's k\) must be an integer >= 1, got 2.0"),
    ({"gradient_accumulation_steps": True}, r"\(PETRA's k\) must be an integer >= 1, got True"),
    ({"gradient_accumulation_steps": -3}, r"\(PETRA's k\) must be >= 1, got -3"),
    ({"gradient_clipping": "1.0"}, r'"gradient_clipping" must be a number .* got \'1.0\''),
    ({"gradient_clipping": -0.5}, r'"gradient_clipping" must be a number >= 0 \(0: off; with PETRA each stage clips'),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, r'the "fp16" section: .*loss_scale must be >= 0'),
    ({"fp16": True}, r'"fp16" must be an object'),
    ({"bf16": "yes"}, r'"bf16" must be an object'),
    ({"torch_autocast": {"enabled": True, "dtype": "float16"}}, r'"torch_autocast" is not supported with PETRA'),
    ({"zero_optimization": {"stage": 3}}, r'"zero_optimization.stage" 3 is not supported with PETRA'),
    ({"zero_optimization": {"stage": "2"}}, r'"zero_optimization.stage" 2 is not supported with PETRA'),
    ({"zero_optimization": {"stage": "one"}}, r"\"zero_optimization.stage\" must be 0 with PETRA, got 'one'"),
    ({"zero_optimization": True}, r'"zero_optimization": true \(ZeRO stage 1\) is not supported'),
    ({"zero_optimization": 1}, r'"zero_optimization" must be an object'),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     r'"zero_optimization.offload_optimizer" is not supported with PETRA: offloading is part of ZeRO'),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}},
     r'"zero_optimization.offload_param" is not supported'),
    ({"zero_optimization": {"stage": 0, "cpu_offload": True}}, r'"zero_optimization.cpu_offload" is not supported'),
])
def test_a_config_petra_cannot_run_is_refused_by_name(extra, message):
    with pytest.raises(PetraConfigError, match=message):
        split_config({**BASE, "petra": {}, **extra})


@pytest.mark.parametrize("extra", [
    {"fp16": {"enabled": False}},
    {"fp16": None, "bf16": None, "torch_autocast": {"enabled": False}},
    {"gradient_clipping": 0},
    {"gradient_clipping": 0.0},
    {"gradient_clipping": 1.0},
    {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none"}, "reduce_bucket_size": 5e8}},
    {"zero_optimization": False},
    {"gradient_accumulation_steps": None, "train_batch_size": 8},  # DeepSpeed derives k
    {"petra": None},
])
def test_settings_that_change_nothing_for_petra_are_accepted(extra):
    petra, ds, precision = split_config({**BASE, "petra": {}, **extra})
    assert petra == PetraConfig() and precision.name == "fp32" and "petra" not in ds


# --- property: PetraConfig.from_dict accepts every valid section, refuses every invalid one by name ----

VALID = {
    "stages_per_rank": st.integers(1, 64),
    "input_buffer": st.one_of(st.sampled_from(INPUT_BUFFERS), st.integers(1, 64).map(lambda n: f"first_{n}")),
    "param_buffer": st.booleans(),
    "bn_running_stats": st.sampled_from(BN_RUNNING_STATS),
    "seed": st.integers(-2**31, 2**63 - 1),
    "non_finite": st.sampled_from(NON_FINITE),
    "check_reversible": st.booleans(),
    "check_finite": st.booleans(),
    "gradient_quality_every": st.integers(0, 1000),
}
_not_int = st.one_of(st.floats(allow_nan=False), st.text(max_size=3), st.booleans(), st.none())
INVALID = {
    "stages_per_rank": st.one_of(st.integers(max_value=0), _not_int),
    "input_buffer": st.one_of(st.text(max_size=12).filter(lambda s: s not in INPUT_BUFFERS and kept_first(s) is None),
                              st.sampled_from(["first_0", "first_", "first_x", "first_-2", "every_2"]), st.integers(),
                              st.none()),
    "param_buffer": st.one_of(st.integers(), st.text(max_size=3), st.none()),
    "bn_running_stats": st.one_of(st.text(max_size=12).filter(lambda s: s not in BN_RUNNING_STATS), st.none()),
    "seed": _not_int,
    "non_finite": st.one_of(st.text(max_size=12).filter(lambda s: s not in NON_FINITE), st.integers()),
    "check_reversible": st.one_of(st.integers(), st.text(max_size=3), st.none()),
    "check_finite": st.one_of(st.integers(), st.text(max_size=3), st.none()),
    "gradient_quality_every": st.one_of(st.integers(max_value=-1), _not_int),
}
KNOWN = {f.name for f in fields(PetraConfig)}
valid_sections = st.fixed_dictionaries({}, optional={key: VALID[key] for key in KNOWN & set(VALID)})


@settings(max_examples=150, deadline=None)
@given(section=valid_sections)
def test_every_valid_petra_section_is_accepted_as_written(section):
    config = PetraConfig.from_dict(section)
    for f in fields(PetraConfig):
        assert getattr(config, f.name) == section.get(f.name, f.default)


@settings(max_examples=150, deadline=None)
@given(section=valid_sections, data=st.data())
def test_every_invalid_petra_value_is_refused_naming_its_key(section, data):
    key = data.draw(st.sampled_from(sorted(KNOWN & set(INVALID))))
    bad = data.draw(INVALID[key])
    with pytest.raises(PetraConfigError, match=f'"petra.{key}"'):
        PetraConfig.from_dict({**section, key: bad})


@settings(max_examples=60, deadline=None)
@given(section=valid_sections,
       typo=st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=16).filter(lambda s: s not in KNOWN))
def test_every_unknown_petra_key_is_refused_by_name(section, typo):
    with pytest.raises(PetraConfigError, match=rf"unknown key\(s\) \['{typo}'\] in the \"petra\" config section"):
        PetraConfig.from_dict({**section, typo: 1})


@pytest.mark.parametrize("key", sorted(KNOWN))
def test_every_petra_key_checks_its_type(key):
    """A key added later without a check would accept anything: a list is a valid value of none of them."""
    with pytest.raises(PetraConfigError, match=f'"petra.{key}"'):
        PetraConfig.from_dict({key: [[]]})


@settings(max_examples=60, deadline=None)
@given(k=st.one_of(st.integers(-5, 64), st.floats(allow_nan=False), st.text(max_size=3), st.booleans()))
def test_k_is_accepted_exactly_when_it_is_an_integer_of_at_least_one(k):
    config = {**BASE, "gradient_accumulation_steps": k, "petra": {}}
    if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
        assert split_config(config)[1]["gradient_accumulation_steps"] == k
    else:
        with pytest.raises(PetraConfigError, match=r"\"gradient_accumulation_steps\" \(PETRA's k\) must be"):
            split_config(config)


# --- the model and petra_ds.initialize, in a one-process torch.distributed world ----------------------


def toy(stages_per_rank: int = 4, layers: list | None = None, **kwargs) -> petra_ds.PetraPipelineModule:
    kwargs.setdefault("num_stages", None if "topology" in kwargs else 1)
    return petra_ds.PetraPipelineModule(toy_layer_specs() if layers is None else layers,
                                        loss_fn=nn.CrossEntropyLoss(), stages_per_rank=stages_per_rank,
                                        partition_method=kwargs.pop("partition_method", "uniform"), **kwargs)


def config(k: int = 2, **petra) -> dict:
    return {**BASE, "gradient_accumulation_steps": k, "petra": {"stages_per_rank": 4, **petra}}


@pytest.mark.parametrize("stages_per_rank,message", [
    (0, r"stages_per_rank must be an integer >= 1 \(PETRA stages per pipeline rank\), got 0"),
    (True, r"stages_per_rank must be an integer >= 1 .* got True"),
    ("2", r"stages_per_rank must be an integer >= 1 .* got '2'"),
])
def test_stages_per_rank_of_the_model_must_be_a_positive_integer(world_of_one, stages_per_rank, message):
    with pytest.raises(ValueError, match=message):
        toy(stages_per_rank)


def test_more_petra_stages_than_layers_is_refused(world_of_one):
    with pytest.raises(ValueError, match=rf"{LAYERS + 1} PETRA stages \(pipeline ranks 1 x stages_per_rank "
                                         rf"{LAYERS + 1}\) for {LAYERS} layers: every stage needs at least one layer"):
        toy(LAYERS + 1)


def test_a_partition_that_leaves_a_stage_empty_is_refused(world_of_one, monkeypatch):
    """DeepSpeed's balanced partition gives every part a layer today; the guard keeps a stage without
    layers (which would have nothing to step and nothing to send) from reaching the engine if it stops."""
    from deepspeed.runtime import utils as ds_utils

    monkeypatch.setattr(ds_utils, "partition_balanced", lambda weights, num_parts: [0, 2, 2, 3, len(weights)])
    with pytest.raises(ValueError, match=r"partition \[0, 2, 2, 3, 9\] leaves a PETRA stage without layers; "
                                         r"use partition_method='uniform'"):
        toy(4, partition_method="parameters")


@pytest.mark.parametrize("pipe,data", [(2, 1), (1, 2), (2, 2)])
def test_a_topology_that_does_not_cover_the_world_is_refused_before_deepspeed_builds_its_grid(world_of_one, pipe, data):
    topology = PipeDataParallelTopology(num_pp=pipe, num_dp=data)
    with pytest.raises(ValueError, match=rf"the topology \(pipe {pipe} x data {data} = {pipe * data} processes\) does "
                                         r"not match the 1 processes of this run .* launch"):
        toy(1, topology=topology)


@pytest.mark.parametrize("num_stages,message", [
    (2, r"num_stages=2 pipeline ranks do not divide the 1 processes of this run .* not PETRA stages "
        r"\(J = num_stages x stages_per_rank\): one process hosting J stages is num_stages=1, stages_per_rank=J"),
    (0, r"num_stages \(pipeline ranks\) must be an integer >= 1, got 0"),
])
def test_num_stages_must_divide_the_world(world_of_one, num_stages, message):
    with pytest.raises(ValueError, match=message):
        toy(1, num_stages=num_stages)


def test_the_model_needs_torch_distributed(monkeypatch):
    monkeypatch.setattr(ds_comm, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs torch.distributed: call petra_ds.init_distributed\(\)"):
        toy(1)


def test_a_model_that_is_not_a_pipeline_module_is_refused(world_of_one):
    with pytest.raises(TypeError, match=r"PETRA needs a deepspeed.pipe.PipelineModule .* got Sequential"):
        petra_ds.initialize(model=nn.Sequential(nn.Linear(6, 3)), config=config())


def test_a_pipeline_module_wrapped_by_torch_compile_is_refused_with_the_compile_key(world_of_one):
    with pytest.raises(TypeError, match=r'not torch.compile\(model\): .* "petra": \{"compile": true\}'):
        petra_ds.initialize(model=torch.compile(toy()), config=config())


def test_an_optimizer_is_required(world_of_one):
    no_optimizer = {key: value for key, value in config().items() if key != "optimizer"}
    with pytest.raises(PetraConfigError, match=r'PETRA needs an optimizer: add an "optimizer" section or pass optimizer='):
        petra_ds.initialize(model=toy(), config=no_optimizer)


def test_a_config_is_required(world_of_one):
    with pytest.raises(PetraConfigError, match="no DeepSpeed config: pass config=... or --deepspeed_config"):
        petra_ds.initialize(model=toy())


def test_stages_per_rank_of_config_and_model_must_agree(world_of_one):
    with pytest.raises(PetraConfigError, match=r'"petra.stages_per_rank" is 2 but the model was built with '
                                               r"stages_per_rank=4; build it with petra_ds.PetraPipelineModule"):
        petra_ds.initialize(model=toy(4), config=config(stages_per_rank=2))


def test_a_petra_model_without_a_petra_section_is_refused(world_of_one):
    plain = {key: value for key, value in config().items() if key != "petra"}
    with pytest.raises(PetraConfigError, match=r'stages_per_rank=4 but the config has no "petra" section, so DeepSpeed '
                                               r'would run its own 1F1B schedule; add "petra": \{"stages_per_rank": 4\}'):
        petra_ds.initialize(model=toy(4), config=plain)


def test_one_optimizer_or_scheduler_instance_cannot_serve_several_stages(world_of_one):
    model = toy()
    no_optimizer = {key: value for key, value in config().items() if key != "optimizer"}
    with pytest.raises(PetraConfigError, match=r"an optimizer instance cannot serve several PETRA stages .* "
                                               r"pass a callable `optimizer=lambda params: ...`"):
        petra_ds.initialize(model=model, config=no_optimizer, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    with pytest.raises(PetraConfigError, match=r"an LR scheduler instance cannot serve several PETRA stages; "
                                               r"pass a callable `lr_scheduler=lambda optimizer: ...`"):
        petra_ds.initialize(model=toy(), config=config(), lr_scheduler=scheduler)


# --- what the engine refuses at run time (one process hosting the 4 stages) -----------------------------


@pytest.fixture
def engine(world_of_one):
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    engine, *_ = petra_ds.initialize(model=toy(), config=config())
    yield engine
    torch.set_default_dtype(dtype)


def test_train_batch_needs_a_data_iterator(engine):
    with pytest.raises(ValueError, match=r"train_batch\(\) needs a data iterator \(or training_data in initialize\)"):
        engine.train_batch()


def test_train_batch_needs_gradients(engine):
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"requires gradients enabled; use eval_batch\(\) instead"):
        engine.train_batch(iter(toy_data(2, 4)))


def test_the_data_must_be_input_label_pairs(engine):
    with pytest.raises(ValueError, match=r"the data iterator must yield \(inputs, labels\) pairs"):
        engine.train_batch(iter([x for x, _y in toy_data(2, 4)]))


def test_a_micro_batch_of_another_shape_is_refused_naming_both_layouts(engine):
    """The in-process twin of tests/test_engine_config.py's two-process test: the first micro-batch fixes
    the layout of every message."""
    data = toy_data(4, 4)
    data[3] = (data[3][0][:-1], data[3][1][:-1])
    engine.train_batch(iter(data))
    with pytest.raises(MessageLayoutError, match=r"micro-batch 3 has layout \(float64\[3, 6\], int64\[3\]\) but the "
                                                 r"first one had \(float64\[4, 6\], int64\[4\]\).*drop_last=True"):
        engine.train_batch(iter(data[2:]))


def test_a_data_iterator_that_runs_out_inside_a_train_batch_call_is_named(engine):
    k = engine.micro_batches
    assert k > 1
    with pytest.raises(ValueError, match=r"the data iterator ran out at micro-batch 1 \(clock 1\) inside a train_batch "
                                         rf"call of {k} clocks; give it k micro-batches per call"):
        engine.train_batch(iter(toy_data(1, 4)))

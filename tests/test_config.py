"""The "petra" config section and what PETRA refuses from the rest of a DeepSpeed config."""

import pytest
import torch

from petra_ds.runtime.config import PetraConfig, PetraConfigError, split_config

BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_defaults_and_bf16_taken_out_of_deepspeeds_hands():
    petra, ds, precision = split_config({**BASE, "petra": {}, "bf16": {"enabled": True}})
    assert petra == PetraConfig()
    assert precision.name == "bf16" and "bf16" not in ds and "petra" not in ds and ds["optimizer"] == BASE["optimizer"]


@pytest.mark.parametrize("section,message", [
    ({"stages_per_rnak": 2}, r"unknown key\(s\) \['stages_per_rnak'\] in the \"petra\" config section"),
    ({"stages_per_rank": 0}, r'"petra.stages_per_rank" must be an integer >= 1, got 0'),
    ({"input_buffer": "some"}, r'"petra.input_buffer" must be one of'),
    ({"input_buffer": "first_0"}, r'or "first_N" with N >= 1'),
    ({"param_buffer": "yes"}, r'"petra.param_buffer" must be true or false'),
    ({"bn_running_stats": "eval"}, r'"petra.bn_running_stats" must be one of'),
])
def test_bad_petra_values_name_the_key(section, message):
    with pytest.raises(PetraConfigError, match=message):
        split_config({**BASE, "petra": section})


@pytest.mark.parametrize("extra,message", [
    ({"gradient_clipping": -1.0}, '"gradient_clipping" must be a number >= 0'),
    ({"zero_optimization": {"stage": 1}}, '"zero_optimization.stage" 1 is not supported'),
    ({"gradient_accumulation_steps": 0}, "PETRA's k\\) must be >= 1"),
])
def test_settings_that_need_a_cross_stage_collective_are_refused(extra, message):
    with pytest.raises(PetraConfigError, match=message):
        split_config({**BASE, **extra, "petra": {}})


def test_non_finite_and_check_reversible_values_are_validated():
    with pytest.raises(PetraConfigError, match=r'"petra.non_finite" must be one of \(\'raise\', \'skip\'\)'):
        PetraConfig.from_dict({"non_finite": "ignore"})
    with pytest.raises(PetraConfigError, match='"petra.check_reversible" must be true or false'):
        PetraConfig.from_dict({"check_reversible": "yes"})


@pytest.mark.parametrize("name", ["PETRA", "Petra", "petra_", "petr"])
def test_a_section_named_almost_petra_is_refused_instead_of_training_1f1b(name, world_of_one):
    import petra_ds
    from petra_ds.runtime.config import PetraConfigError

    with pytest.raises(PetraConfigError, match=f'has a "{name}" section, which is not "petra"'):
        petra_ds.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1, name: {}})


@pytest.mark.parametrize("optimizer, builds", [
    ({"type": "AdamW", "params": {"lr": 1e-3}}, "FusedAdam"),
    ({"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, None),
    ({"type": "muon", "params": {"momentum": 0.95}}, "FusedAdam"),
    ({"type": "muon", "params": {"torch_adam": True}}, None),
    ({"type": "Lamb", "params": {"lr": 1e-3}}, "FusedLamb"),
    ({"type": "SGD", "params": {"lr": 1e-3}}, None),
])
def test_a_jit_build_on_a_gpu_is_announced_with_what_avoids_it(optimizer, builds):
    from petra_ds.runtime.config import jit_build_notice

    notice = jit_build_notice({"optimizer": optimizer}, {}, cuda=True)
    assert (notice is None) == (builds is None)
    if builds:
        assert builds in notice and "nvcc" in notice
        assert ('"torch_adam": true' in notice) == (optimizer["type"] != "Lamb")
    assert jit_build_notice({"optimizer": optimizer}, {}, cuda=False) is None


def test_the_jit_notice_names_the_arch_list_suffix_deepspeed_cannot_parse():
    from petra_ds.runtime.config import jit_build_notice

    notice = jit_build_notice({"optimizer": {"type": "AdamW"}}, {"TORCH_CUDA_ARCH_LIST": "9.0a"}, cuda=True)
    assert "TORCH_CUDA_ARCH_LIST='9.0a'" in notice and "9.0a -> 9.0" in notice
    assert "TORCH_CUDA_ARCH_LIST" not in jit_build_notice({"optimizer": {"type": "AdamW"}},
                                                          {"TORCH_CUDA_ARCH_LIST": "8.0;9.0"}, cuda=True)

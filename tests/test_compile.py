"""``"petra": {"compile": ...}``: every stage's forward, reconstruction and VJP through ``torch.compile``, against
the same engine in eager mode, in float64 on CPU with keyed dropout, all stages in one process."""

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

import petra_ds
from petra_ds.runtime.config import PetraConfig, PetraConfigError
from petra_ds.tools.toy import toy_data, toy_layer_specs

J, K = 3, 2


def train(world_of_one, compile_setting):
    torch.set_default_dtype(torch.float64)
    model = petra_ds.PetraPipelineModule(
        toy_layer_specs(0.1, False), topology=PipeDataParallelTopology(num_pp=1, num_dp=1),
        loss_fn=torch.nn.CrossEntropyLoss(), stages_per_rank=J, partition_method="uniform", base_seed=1234)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": K, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
              "petra": {"stages_per_rank": J, "compile": compile_setting}}
    engine, *_ = petra_ds.initialize(model=model, config=config)
    data = iter(toy_data(4 * K, 4, 0, torch.float64))
    losses = [engine.train_batch(data).item() for _ in range(4)] + [engine.drain().item()]
    return losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}, engine


def compiled_modules(engine) -> int:
    return sum(1 for m in engine.module.modules() if getattr(m, "_compiled_call_impl", None) is not None)


def assert_same_training(eager, compiled, tol):
    (losses_e, params_e, _), (losses_c, params_c, engine) = eager, compiled
    assert compiled_modules(engine) > 0
    assert params_e.keys() == params_c.keys()  # compiled in place: the same names, the same checkpoints
    assert losses_c[1:] == pytest.approx(losses_e[1:], abs=tol, rel=0)
    assert max((params_e[n] - params_c[n]).abs().max().item() for n in params_e) <= tol


def test_compiled_stages_train_as_eager_ones_do(world_of_one):
    """AOTAutograd's graphs of F, G and the non-reversible layers (``aot_eager``: the capture without the
    code generator): the same bits, dropout included, over 4 windows and a drain."""
    assert_same_training(train(world_of_one, False), train(world_of_one, "aot_eager"), 0.0)


@pytest.mark.slow
def test_inductor_compiled_stages_train_as_eager_ones_do(world_of_one):
    """``"compile": true`` (inductor, C++ code on CPU; about a minute of compiling): float64 rounding apart."""
    assert_same_training(train(world_of_one, False), train(world_of_one, True), 1e-12)


@pytest.mark.parametrize("value", [1, "", None, ["inductor"]])
def test_compile_takes_true_false_or_a_backend_name(value):
    with pytest.raises(PetraConfigError, match='"petra.compile" must be true, false or a torch.compile backend'):
        PetraConfig.from_dict({"compile": value})


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_inductor_modes_that_replay_cuda_graphs_are_refused_with_what_to_set(mode):
    with pytest.raises(PetraConfigError, match=f'"petra.compile": \'{mode}\' replays CUDA graphs.*Set it to true'):
        PetraConfig.from_dict({"compile": mode})
    assert PetraConfig.from_dict({"compile": "max-autotune-no-cudagraphs"}).compile == "max-autotune-no-cudagraphs"

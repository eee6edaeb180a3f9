"""PetraEngine against oracles (tests/oracle.py), on CPU with gloo, in float64."""

import functools
import json

import pytest
import torch

from petra_ds.schedule import delay
from petra_ds.tools.toy import toy_data

import oracle
from harness import launch, merged_grads, merged_params

TOL = 1e-10
SEED = 0  # petra.seed default


@functools.lru_cache(maxsize=None)
def _run(spec_json):
    return launch(json.loads(spec_json))


def run(pipe, stages_per_rank, dp=1, **kw):
    """Launch once per distinct configuration (cached across tests)."""
    spec = {"pipe": pipe, "stages_per_rank": stages_per_rank, "dp": dp, **kw}
    return _run(json.dumps(spec, sort_keys=True))


def max_diff(a, b):
    assert a.keys() == b.keys() and a
    return max((a[n] - b[n]).abs().max().item() for n in a)


SGD0 = {"type": "SGD", "params": {"lr": 0.0}}
SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}


def test_lr0_every_stage_gradient_equals_autograd():
    """J = 4 over 4 processes, reversible and non-reversible stages mixed, dropout on."""
    k, batches = 2, 4
    results = run(4, 1, k=k, train_batches=batches, optimizer=SGD0, dropout=0.1)
    assert {j: r for res in results for j, r in res["reconstructs"].items()} == {0: False, 1: True, 2: False, 3: False}
    grads = merged_grads(results)
    stages = oracle.build_stages(4, dropout=0.1)
    data = toy_data(k * batches, 4)
    for step in range(batches):
        ref = oracle.autograd_group_grads(stages, data, range(step * k, (step + 1) * k), SEED)
        for j in range(4):
            assert max_diff(grads[j][step], ref[j]) < TOL, (step, j)


def test_single_stage_is_backprop_with_accumulation():
    k, batches = 3, 4
    results = run(1, 1, k=k, train_batches=batches, optimizer=SGD, dropout=0.1)
    (stage,) = oracle.build_stages(1, dropout=0.1)
    params = oracle.named_params(stage)
    opt = torch.optim.SGD(list(params.values()), lr=0.1, momentum=0.9)
    data = toy_data(k * batches, 4)
    for step in range(batches):
        opt.zero_grad()
        oracle.backprop_group(stage, data, range(step * k, (step + 1) * k), SEED, k)
        assert max_diff(results[0]["grads"][0][step], {n: p.grad for n, p in params.items()}) < TOL
        opt.step()
    assert max_diff(results[0]["params"], {n: p.detach() for n, p in params.items()}) < TOL


def test_layout_invariance():
    """1 rank x 4 stages, 2 x 2 and 4 x 1: identical parameters after 4k clocks with lr > 0."""
    runs = [merged_params(run(p, s, k=2, train_batches=4, optimizer=SGD, dropout=0.1)) for p, s in [(1, 4), (2, 2), (4, 1)]]
    assert max_diff(runs[0], runs[1]) < 1e-12
    assert max_diff(runs[0], runs[2]) < 1e-12
    before = oracle.named_params([l for s in oracle.build_stages(4, 0.1) for l in s])
    assert max_diff(runs[0], {n: p.detach() for n, p in before.items()}) > 1e-3, "training must move the weights"


def test_data_parallel_invariance():
    """2 pipeline replicas x micro-batch b equal 1 replica x micro-batch 2b (no batch statistics)."""
    two = merged_params(run(2, 1, dp=2, k=2, micro_batch=3, train_batches=3, optimizer=SGD, dropout=0.0))
    one = merged_params(run(2, 1, dp=1, k=2, micro_batch=6, train_batches=3, optimizer=SGD, dropout=0.0))
    assert max_diff(two, one) < TOL


@pytest.mark.parametrize("input_buffer_all,param_buffer", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["petra", "input_buffer", "param_buffer", "delayed_gradients"])
def test_variant_equals_direct_reference(input_buffer_all, param_buffer):
    k, batches = 2, 4
    petra = {"input_buffer": "all" if input_buffer_all else "non_reversible", "param_buffer": param_buffer}
    results = run(1, 4, k=k, train_batches=batches, optimizer=SGD, dropout=0.1, petra=petra)
    final, grads = oracle.delayed_training(oracle.build_stages(4, 0.1), toy_data(k * batches, 4), k, 0.1, 0.9, SEED,
                                           input_buffer_all=input_buffer_all, param_buffer=param_buffer)
    assert max_diff(results[0]["params"], final) < TOL
    for j in range(4):
        assert len(results[0]["grads"][j]) == len(grads[j]) == batches
        for got, want in zip(results[0]["grads"][j], grads[j]):
            assert max_diff(got, want) < TOL


@pytest.mark.parametrize("J", [7, 8])
def test_the_first_stages_keeping_their_inputs_equals_the_reference(J):
    """``input_buffer: "first_2"``: stages 1 and 2 keep their exact inputs, the later reversible ones reconstruct
    (J = 7: 3 and 5; J = 8: 3, 4 and 6), as in the float64 oracle making the same choice. Where the choice shows,
    J = 7 at stage 2 and J = 8 at stage 3 (an additive coupling whose backward reads its input), the training
    differs from the all-reconstructing or the all-keeping one."""
    k, batches = 2, 4
    results = run(1, J, k=k, train_batches=batches, optimizer=SGD, dropout=0.1, petra={"input_buffer": "first_2"})
    reference = [oracle.delayed_training(oracle.build_stages(J, 0.1), toy_data(k * batches, 4), k, 0.1, 0.9, SEED,
                                         input_buffer_all=keep_all, kept_first=first)
                 for keep_all, first in ((False, 2), (False, None), (True, None))]
    (final, grads), others = reference[0], [r[0] for r in reference[1:]]
    assert max_diff(results[0]["params"], final) < TOL
    for j in range(J):
        assert len(results[0]["grads"][j]) == len(grads[j]) == batches
        for mine, want in zip(results[0]["grads"][j], grads[j]):
            assert max_diff(mine, want) < TOL
    assert max(max_diff(final, other) for other in others) > 1e-8


@pytest.mark.parametrize("pipe", [2, 3])
def test_deepspeeds_own_pipeline_module_trains_as_the_oracle(pipe):
    """``deepspeed.pipe.PipelineModule`` with a "petra" config, J = P ranks: the same delayed training as
    PetraPipelineModule's, against the float64 oracle (its start-up settings print read a partition only ours has)."""
    k, batches = 2, 4
    results = run(pipe, 1, k=k, train_batches=batches, optimizer=SGD, dropout=0.1, plain_module=True,
                  config={"gradient_clipping": 0.0})  # the oracle does not clip; DeepSpeed clips at 1 by default
    final, grads = oracle.delayed_training(oracle.build_stages(pipe, 0.1), toy_data(k * batches, 4), k, 0.1, 0.9, SEED)
    assert max_diff(merged_params(results), final) < TOL
    got = {j: g for r in results for j, g in r["grads"].items()}
    for j in range(pipe):
        assert len(got[j]) == len(grads[j]) == batches
        for mine, want in zip(got[j], grads[j]):
            assert max_diff(mine, want) < TOL


def test_variants_differ_from_each_other():
    """The ablations are not the same computation in disguise."""
    k = 2
    finals = [oracle.delayed_training(oracle.build_stages(4, 0.1), toy_data(k * 4, 4), k, 0.1, 0.9, SEED, a, b)[0]
              for a, b in [(False, False), (True, True)]]
    assert max_diff(*finals) > 1e-8


def test_memory_report_buffers_follow_the_clock():
    J, k, batches = 4, 2, 4
    results = run(4, 1, k=k, train_batches=batches, optimizer=SGD, dropout=0.1, memory_trace=True)
    M = k * batches
    for res in results:
        for clock, report in res["memory"]:
            for j, entry in report.items():
                assert entry["param_buffer"] == 0
                in_flight = sum(1 for m in range(M) if m + j <= clock < m + j + delay(j, J))
                if res["reconstructs"][j] or j in (0, J - 1):
                    assert entry["input_buffer"] == 0 and entry["input_buffer_micro_batches"] == 0, (clock, j)
                else:
                    assert entry["input_buffer_micro_batches"] == in_flight, (clock, j)
                    assert entry["input_buffer"] == in_flight * 4 * 8 * 8  # pair of (4, 4) float64
                if j == 0:
                    assert entry["raw_micro_batches"] == in_flight * 4 * 6 * 8
        for j, entry in res["memory"][-1][1].items():
            kept = 0 if (res["reconstructs"][j] or j in (0, J - 1)) else delay(j, J) + 1
            assert entry["input_buffer_peak"] == kept * 4 * 8 * 8, j


def test_param_buffer_holds_one_copy_per_micro_batch_in_flight():
    J, k = 4, 2
    results = run(1, 4, k=k, train_batches=4, optimizer=SGD, dropout=0.1, memory_trace=True, petra={"param_buffer": True})
    for clock, report in results[0]["memory"]:
        for j, entry in report.items():
            in_flight = sum(1 for m in range(8) if m + j <= clock < m + j + delay(j, J))
            assert entry["param_buffer"] == in_flight * entry["params"], (clock, j)


def test_exact_resume_in_fresh_processes(tmp_path):
    """Save at clock c mid-flight (no drain), start fresh processes, load, continue: same parameters."""
    common = dict(k=2, train_batches=5, optimizer=SGD, dropout=0.1, petra={"input_buffer": "non_reversible"})
    whole = merged_params(run(2, 2, **common))
    ckpt = str(tmp_path / "ckpt")
    first = launch({"pipe": 2, "stages_per_rank": 2, **common, "save_dir": ckpt, "save_after": 2, "save_tag": "c4"})
    assert max_diff(merged_params(first), whole) == 0.0
    resumed = launch({"pipe": 2, "stages_per_rank": 2, **common, "load_dir": ckpt}, fresh=True)
    assert resumed[0]["clock"] == first[0]["clock"]
    assert max_diff(merged_params(resumed), whole) == 0.0
    assert sorted(p.name for p in (tmp_path / "ckpt" / "c4").iterdir()) == [
        "layer_00-model_states.pt", "layer_01-model_states.pt", "layer_02-model_states.pt",
        "layer_03-model_states.pt", "layer_04-model_states.pt", "layer_05-model_states.pt",
        "layer_06-model_states.pt", "layer_07-model_states.pt", "layer_08-model_states.pt",
        "petra_stage-00-data_00.pt", "petra_stage-01-data_00.pt", "petra_stage-02-data_00.pt",
        "petra_stage-03-data_00.pt"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "c4"


PLAIN_LOAD = """
import sys, torch, petra_ds
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from petra_ds.tools.toy import toy_layer_specs
petra_ds.init_distributed(dist_backend="gloo")
torch.set_default_dtype(torch.float64)
module = PipelineModule(toy_layer_specs(0.1), num_stages=1, loss_fn=torch.nn.CrossEntropyLoss(),
                        partition_method="uniform")
module.load_state_dir(sys.argv[1], checkpoint_engine=TorchCheckpointEngine())
torch.save({f"{i}.{n}": p.detach() for i, layer in enumerate(module.forward_funcs)
            for n, p in layer.named_parameters()}, sys.argv[2])
"""


def test_a_plain_deepspeed_pipeline_module_loads_the_layer_files(tmp_path):
    import subprocess
    import sys

    ckpt = tmp_path / "ckpt"
    results = launch({"pipe": 2, "stages_per_rank": 2, "k": 2, "train_batches": 3, "drain": False,
                      "optimizer": SGD, "save_dir": str(ckpt), "save_after": 3, "save_tag": "end"})
    out = tmp_path / "plain.pt"
    proc = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(ckpt / "end"), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_diff(torch.load(out), merged_params(results)) == 0.0


def test_eval_uses_current_parameters_and_does_not_disturb_training():
    common = dict(k=2, train_batches=4, optimizer=SGD, dropout=0.1)
    plain = merged_params(run(2, 2, **common))
    results = run(2, 2, **common, eval_every=True, eval_batches=1)
    assert max_diff(merged_params(results), plain) == 0.0, "eval between train_batch calls changed training"
    stages = oracle.build_stages(4, dropout=0.1)
    final = merged_params(results)
    with torch.no_grad():
        for stage in stages:
            for idx, layer in stage:
                layer.eval()
                for n, p in layer.named_parameters():
                    p.copy_(final[f"{idx}.{n}"])
        data = toy_data(2 * 4, 4)
        losses = []
        for x, y in data[:2]:
            for stage in stages:
                x = oracle.run(stage, x)
            losses.append(oracle.LOSS(x, y))
    expected = torch.stack(losses).mean().item()
    assert len(results) == 2 and all(r["evals"][0] == pytest.approx(expected, abs=1e-6) for r in results)

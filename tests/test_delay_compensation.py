"""Delay compensation and per-stage gradient clipping against the written-out update rules of
tests/oracle.py (float64, the toy model, dropout on), and what must stay exact: lr = 0, J = 1, resume."""

import pytest
import torch

from petra_ds.runtime.compensation import DelayCompensation, LrRescale, WeightPrediction
from petra_ds.runtime.config import PetraConfig, PetraConfigError
from petra_ds.tools.toy import toy_data

import oracle
from harness import launch, merged_params
from test_engine import SEED, SGD, SGD0, TOL, max_diff, run

K, BATCHES = 2, 5
METHODS = [
    {"method": "weight_prediction"},
    {"method": "weight_prediction", "scale": 2.0, "beta": 0.5},
    {"method": "lr_rescale", "anneal_steps": 3},
    {"method": "error_feedback"},
    {"method": "error_feedback", "scale": 0.5},
]


def reference(compensation=None, clip=0.0):
    return oracle.delayed_training(oracle.build_stages(4, 0.1), toy_data(K * BATCHES, 4), K, 0.1, 0.9, SEED,
                                   compensation=compensation, clip=clip)


@pytest.mark.parametrize("compensation", METHODS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_each_method_equals_its_update_rule(compensation):
    """J = 4 (stage 1 reconstructs, stage 0 recomputes), SGD with momentum: parameters and every step's
    gradient equal the oracle's, and the method changed training (it is not plain PETRA in disguise)."""
    results = run(1, 4, k=K, train_batches=BATCHES, optimizer=SGD, dropout=0.1,
                  petra={"delay_compensation": compensation})
    final, grads = reference(compensation)
    assert max_diff(results[0]["params"], final) < TOL
    for j in range(4):
        assert len(results[0]["grads"][j]) == len(grads[j]) == BATCHES
        for got, want in zip(results[0]["grads"][j], grads[j]):
            assert max_diff(got, want) < TOL
    plain, _ = reference()
    assert max_diff(final, plain) > 1e-6


def test_per_stage_clipping_equals_clipping_each_stage_by_its_own_norm():
    clip = 0.05
    results = run(1, 4, k=K, train_batches=BATCHES, optimizer=SGD, dropout=0.1, config={"gradient_clipping": clip})
    final, grads = reference(clip=clip)
    assert max_diff(results[0]["params"], final) < TOL
    norms = []
    for j in range(4):
        for got, want in zip(results[0]["grads"][j], grads[j]):
            assert max_diff(got, want) < TOL
            norms.append(float(torch.sqrt(sum((g ** 2).sum() for g in got.values()))))
    assert max(norms) <= clip * (1 + 1e-9)
    unclipped, _ = reference()
    assert max_diff(final, unclipped) > 1e-6, "the clip must bind at some step"


def test_weight_prediction_at_lr0_leaves_every_gradient_equal_to_autograd():
    """lr = 0: every update is 0, so the predicted weights are the weights (the lr = 0 oracle stays exact)."""
    results = run(1, 4, k=K, train_batches=3, optimizer=SGD0, dropout=0.1,
                  petra={"delay_compensation": "weight_prediction"})
    stages = oracle.build_stages(4, dropout=0.1)
    data = toy_data(K * 3, 4)
    for step in range(3):
        ref = oracle.autograd_group_grads(stages, data, range(step * K, (step + 1) * K), SEED)
        for j in range(4):
            assert max_diff(results[0]["grads"][j][step], ref[j]) < TOL


@pytest.mark.parametrize("compensation", ["weight_prediction", "lr_rescale", "error_feedback"])
def test_a_single_stage_is_still_backprop(compensation):
    """J = 1 has no delay: any compensation is the identity there."""
    plain = merged_params(run(1, 1, k=3, train_batches=4, optimizer=SGD, dropout=0.1))
    compensated = merged_params(run(1, 1, k=3, train_batches=4, optimizer=SGD, dropout=0.1,
                                    petra={"delay_compensation": compensation}))
    assert max_diff(plain, compensated) == 0.0


@pytest.mark.parametrize("petra", [{"delay_compensation": {"method": "weight_prediction", "beta": 0.5}},
                                   {"delay_compensation": "error_feedback"},
                                   {"delay_compensation": "weight_prediction", "synchronous_steps": 3}],
                         ids=["prediction", "feedback", "inside-synchronous-steps"])
def test_a_buffered_method_resumes_exactly(tmp_path, petra):
    """Weight prediction's averaged update d and error feedback's last update are checkpointed with the
    stage: a resumed run continues bit for bit, also from a checkpoint written inside ``synchronous_steps``."""
    common = dict(k=K, train_batches=4, optimizer=SGD, dropout=0.1, petra=petra)
    whole = merged_params(run(2, 2, **common))
    ckpt = str(tmp_path / "ckpt")
    launch({"pipe": 2, "stages_per_rank": 2, **common, "save_dir": ckpt, "save_after": 2, "save_tag": "mid"})
    resumed = launch({"pipe": 2, "stages_per_rank": 2, **common, "load_dir": ckpt})
    assert max_diff(merged_params(resumed), whole) == 0.0


def test_the_forward_runs_on_predicted_weights_and_gets_the_stored_ones_back():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    prediction = WeightPrediction([w], ahead=1.5, beta=0.0)
    with prediction.forward_weights():  # no update yet: nothing to extrapolate
        assert torch.equal(w, torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([w], lr=0.5)
    w.grad = torch.tensor([1.0, -1.0])
    prediction.step(opt.step, opt, 1)
    storage = w.data_ptr()
    x = torch.tensor([3.0, 4.0], requires_grad=True)
    tape = (w * x).sum()  # a graph that saved w before the forward (a reconstruction's, earlier in the clock)
    with prediction.forward_weights():  # in the weight's own storage, which a CUDA graph reads
        assert torch.equal(w, torch.tensor([0.5, 2.5]) + 1.5 * torch.tensor([-0.5, 0.5]))
        assert w.data_ptr() == storage
    assert w.data_ptr() == storage and torch.equal(w, torch.tensor([0.5, 2.5]))
    (dx,) = torch.autograd.grad(tape, [x])  # autograd does not see an in-place change it would refuse
    assert torch.equal(dx, torch.tensor([0.5, 2.5]))


def test_lr_rescale_divides_by_the_delay_then_anneals_to_the_schedule():
    rescale = LrRescale(steps_behind=4.0, anneal_steps=2)
    assert [rescale.factor(t) for t in (1, 2, 3, 4)] == [0.25, 0.5, 1.0, 1.0]
    assert LrRescale(steps_behind=0.5, anneal_steps=2).factor(1) == 1.0  # under one step behind: no change
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.ones(1)
    rescale.step(opt.step, opt, 1)
    assert w.item() == -0.25 and opt.param_groups[0]["lr"] == 1.0


@pytest.mark.parametrize("value,message", [
    ("nesterov", r'"petra.delay_compensation.method" must be one of'),
    ({"method": "weight_prediction", "horizon": 2}, r"unknown key\(s\) \['horizon'\]"),
    ({"method": "weight_prediction", "beta": 1.0}, r'"petra.delay_compensation.beta" must be in \[0, 1\)'),
    ({"method": "lr_rescale", "anneal_steps": 0}, r'"petra.delay_compensation.anneal_steps" must be an integer >= 1'),
    (3, r'"petra.delay_compensation" must be a method name'),
])
def test_a_bad_delay_compensation_is_refused_by_name(value, message):
    with pytest.raises(PetraConfigError, match=message):
        PetraConfig.from_dict({"delay_compensation": value})


def test_weight_stashing_and_compensation_are_not_combined():
    with pytest.raises(PetraConfigError, match="cannot be combined"):
        PetraConfig.from_dict({"param_buffer": True, "delay_compensation": "lr_rescale"})
    assert PetraConfig.from_dict({}).delay_compensation == DelayCompensation()


def test_the_examples_flag_writes_the_petra_section_and_refuses_a_backprop_config():
    import argparse

    from petra_ds.tools.runs import add_run_arguments, apply_run_arguments

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--delay-compensation", '{"method": "weight_prediction", "beta": 0.5}'])
    config = {"petra": {}}
    assert apply_run_arguments(args, config) == "petra"
    assert PetraConfig.from_dict(config["petra"]).delay_compensation == DelayCompensation("weight_prediction", beta=0.5)
    with pytest.raises(SystemExit, match="is not valid JSON"):
        apply_run_arguments(parser.parse_args(["--delay-compensation", "{method: 1}"]), {"petra": {}})
    args = parser.parse_args(["--delay-compensation", "lr_rescale"])
    with pytest.raises(SystemExit, match='--delay-compensation configure PETRA: use a config that has a "petra"'):
        apply_run_arguments(args, {})
    assert apply_run_arguments(parser.parse_args([]), {}) == "backprop"
    config = {"petra": {}}
    apply_run_arguments(parser.parse_args(["--synchronous-steps", "150"]), config)
    assert PetraConfig.from_dict(config["petra"]).synchronous_steps == 150
    with pytest.raises(SystemExit, match="--synchronous-steps configure PETRA"):
        apply_run_arguments(parser.parse_args(["--synchronous-steps", "150"]), {})


def test_per_stage_clipping_under_bf16_clips_the_fp32_gradients():
    """bf16 autocast keeps fp32 parameters and gradients: clipping sees and writes fp32, as without it."""
    clip = 0.05
    res = launch({"pipe": 1, "stages_per_rank": 4, "k": K, "dtype": "float32", "micro_batch": 8, "dropout": 0.1,
                  "bf16": True, "train_batches": 3, "optimizer": SGD, "config": {"gradient_clipping": clip}})[0]
    norms = [float(torch.sqrt(sum((g.double() ** 2).sum() for g in step.values())))
             for steps in res["grads"].values() for step in steps]
    assert all(g.dtype == torch.float32 for steps in res["grads"].values() for step in steps for g in step.values())
    assert max(norms) <= clip * (1 + 1e-5) and max(norms) > 0.99 * clip
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in res["params"].values())


def test_a_single_stage_with_adamw_and_warmup_cosine_is_backprop():
    """J = 1, the LM example's optimizer and schedule (AdamW, DeepSpeed's WarmupCosineLR): the engine is
    backprop with accumulation to float64 precision, so any gap at J = 1 is float32 noise or dropout masks."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    k, batches, lr = 3, 5, 0.01
    adamw = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.01, "torch_adam": True}}
    schedule = {"type": "WarmupCosineLR", "params": {"total_num_steps": batches, "warmup_num_steps": 2}}
    results = run(1, 1, k=k, train_batches=batches, optimizer=adamw, dropout=0.1, config={"scheduler": schedule})
    (stage,) = oracle.build_stages(1, dropout=0.1)
    params = oracle.named_params(stage)
    opt = torch.optim.AdamW(list(params.values()), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = WarmupCosineLR(opt, total_num_steps=batches, warmup_num_steps=2)
    data = toy_data(k * batches, 4)
    for step in range(batches):
        opt.zero_grad()
        oracle.backprop_group(stage, data, range(step * k, (step + 1) * k), SEED, k)
        opt.step()
        sched.step()
    assert max_diff(results[0]["params"], {n: p.detach() for n, p in params.items()}) < TOL
    assert max_diff(results[0]["params"], oracle.named_params(oracle.build_stages(1, dropout=0.1)[0])) > 1e-3


@pytest.mark.parametrize("compensation", ["weight_prediction", "error_feedback"])
def test_the_memory_report_counts_the_update_a_buffered_method_keeps(compensation):
    """One parameter-sized buffer per delayed stage (the last stage has no delay and keeps nothing): the
    documented cost."""
    res = run(1, 4, k=K, train_batches=2, optimizer=SGD, dropout=0.1, memory_trace=True,
              petra={"delay_compensation": compensation})
    _, report = res[0]["memory"][-1]
    for j, entry in report.items():
        assert entry["delay_compensation"] == (entry["params"] if j < 3 else 0), (j, entry)


# --- optimizer-level methods: Nesterov Adam with constant momentum, the delay-adaptive momentum ---

#: torch's NAdam with its momentum warm-up switched off (0.96 ** (t * 1e9) is 0: mu_t = beta1 from step 1)
NADAM = {"type": "NAdam", "params": {"lr": 0.01, "betas": [0.95, 0.999], "momentum_decay": 1e9,
                                     "decoupled_weight_decay": True, "weight_decay": 0.01}}
#: DeepSpeed clips every gradient at norm 1.0 when the config says nothing; the references do not clip
NO_CLIP = {"gradient_clipping": 0.0}


def nadam_reference(compensation=None, stages=4, batches=BATCHES):
    def hand_written(params, j, moved):
        return oracle.ConstantMomentumNAdam(params, 0.01, (moved(0.95), 0.999), eps=1e-8, weight_decay=0.01)
    return oracle.delayed_training(oracle.build_stages(stages, 0.1), toy_data(K * batches, 4), K, 0.01, 0.0,
                                   SEED, compensation=compensation, optimizer=hand_written)


def assert_engine_equals(optimizer, compensation, reference):
    """J = 4 through the engine (one process, float64, no clipping): final parameters and every step's
    gradients equal ``reference(compensation)``'s; returns the reference's final parameters."""
    petra = {} if compensation is None else {"delay_compensation": compensation}
    results = run(1, 4, k=K, train_batches=BATCHES, optimizer=optimizer, dropout=0.1, petra=petra, config=NO_CLIP)
    final, grads = reference(compensation)
    assert max_diff(results[0]["params"], final) < TOL
    for j in range(4):
        for got, want in zip(results[0]["grads"][j], grads[j]):
            assert max_diff(got, want) < TOL
    return final


NADAM_METHODS = [None, {"method": "adaptive_momentum", "beta1_max": 0.99},
                 [{"method": "weight_prediction"}, {"method": "adaptive_momentum", "beta1_max": 0.99}]]


@pytest.mark.parametrize("compensation", NADAM_METHODS, ids=["nadam", "adaptive", "prediction+adaptive"])
def test_constant_momentum_nadam_and_adaptive_momentum_equal_their_update_rules(compensation):
    """J = 4 through the engine with torch's NAdam from the config equals the hand-written constant-momentum
    Nesterov Adam (and the adaptive coefficient, and weight prediction before it) step for step."""
    final = assert_engine_equals(NADAM, compensation, nadam_reference)
    if compensation is not None:
        plain, _ = nadam_reference()
        assert max_diff(final, plain) > 1e-6


def test_adaptive_momentum_with_sgd_equals_its_rule_and_is_checkpointed_with_the_optimizer(tmp_path):
    """SGD's momentum moves as Adam's beta1 does; the configured value travels in the optimizer's groups,
    so a resumed run continues bit for bit instead of moving the moved coefficient again."""
    compensation = {"method": "adaptive_momentum", "beta1_max": 0.99}
    results = run(1, 4, k=K, train_batches=BATCHES, optimizer=SGD, dropout=0.1,
                  petra={"delay_compensation": compensation})
    final, _ = reference(compensation)
    assert max_diff(results[0]["params"], final) < TOL
    common = dict(k=K, train_batches=4, optimizer=SGD, dropout=0.1, petra={"delay_compensation": compensation})
    whole = merged_params(run(2, 2, **common))
    ckpt = str(tmp_path / "ckpt")
    launch({"pipe": 2, "stages_per_rank": 2, **common, "save_dir": ckpt, "save_after": 2, "save_tag": "mid"})
    resumed = launch({"pipe": 2, "stages_per_rank": 2, **common, "load_dir": ckpt})
    assert max_diff(merged_params(resumed), whole) == 0.0


@pytest.mark.parametrize("compensation", NADAM_METHODS[1:], ids=["adaptive", "prediction+adaptive"])
def test_a_single_stage_with_nadam_is_plain_nadam_training(compensation):
    """J = 1: no delay, so every method is the identity and the run is the optimizer's own training."""
    compensated = run(1, 1, k=K, train_batches=4, optimizer=NADAM, dropout=0.1,
                      petra={"delay_compensation": compensation}, config=NO_CLIP)
    plain = run(1, 1, k=K, train_batches=4, optimizer=NADAM, dropout=0.1, config=NO_CLIP)
    assert max_diff(merged_params(compensated), merged_params(plain)) == 0.0
    final, _ = nadam_reference(stages=1, batches=4)
    assert max_diff(merged_params(plain), final) < TOL


def test_combined_methods_parse_and_refuse_what_cannot_run():
    parsed = PetraConfig.from_dict({"delay_compensation": ["weight_prediction", "adaptive_momentum"]})
    assert parsed.delay_compensation.method == "weight_prediction+adaptive_momentum"
    assert PetraConfig.from_dict({"delay_compensation": ["none", "lr_rescale"]}).delay_compensation == \
        DelayCompensation("lr_rescale")
    with pytest.raises(PetraConfigError, match="names a method twice"):
        PetraConfig.from_dict({"delay_compensation": ["weight_prediction", {"method": "weight_prediction"}]})
    with pytest.raises(PetraConfigError, match=r'"petra.delay_compensation.beta1_max" must be in \[0, 1\)'):
        PetraConfig.from_dict({"delay_compensation": {"method": "adaptive_momentum", "beta1_max": 1.0}})
    with pytest.raises(PetraConfigError, match="cannot be combined"):
        PetraConfig.from_dict({"param_buffer": True, "delay_compensation": ["weight_prediction", "lr_rescale"]})


def test_adaptive_momentum_names_an_optimizer_without_momentum():
    w = torch.nn.Parameter(torch.zeros(2))
    stage = DelayCompensation("adaptive_momentum").for_stage([w], stage=0, petra_stages=2, k=2)  # s_0 = 1
    assert stage.beta1(0.9) == pytest.approx(0.9 + 0.09 * 0.5)
    opt = torch.optim.Adagrad([w], lr=0.1)
    w.grad = torch.ones(2)
    with pytest.raises(ValueError, match="Adagrad has neither"):
        stage.step(opt.step, opt, 1)


# --- DeepSpeed's Muon per stage: hidden matrices orthogonalized, AdamW for the rest ---

MUON = {"type": "muon", "params": {"lr": 0.01, "momentum": 0.95, "betas": [0.9, 0.95], "eps": 1e-8,
                                   "weight_decay": 0.01, "torch_adam": True}}


def muon_reference(compensation=None):
    """Each stage's own DeepSpeed ``MuonWithAuxAdam`` (the library's update rule), its Muon half chosen here
    from the layers: ``nn.Linear`` weights outside the first and the last layer."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    stages = oracle.build_stages(4, 0.1)
    last = max(idx for stage in stages for idx, _ in stage)
    hidden = {id(m.weight) for stage in stages for idx, layer in stage if 0 < idx < last
              for m in layer.modules() if isinstance(m, torch.nn.Linear)}

    def per_stage(params, j, moved):
        muon = [p for p in params if id(p) in hidden]
        adam = [p for p in params if id(p) not in hidden]
        groups = [dict(params=muon, use_muon=True, lr=0.01, momentum=moved(0.95), weight_decay=0.01),
                  dict(params=adam, use_muon=False, lr=0.01, betas=(moved(0.9), 0.95), eps=1e-8, weight_decay=0.01)]
        return MuonWithAuxAdam([g for g in groups if g["params"]], adam_optimizer=torch.optim.AdamW)

    torch._dynamo.config.disable = True
    assert hidden, "the toy model must have hidden matrices for this test to mean anything"
    return oracle.delayed_training(stages, toy_data(K * BATCHES, 4), K, 0.01, 0.0, SEED,
                                   compensation=compensation, optimizer=per_stage)


def test_muon_tags_the_hidden_matrices_of_a_pipeline(world_of_one):
    """Embeddings, head, norms and biases go to AdamW; every block's linear weight to Muon."""
    from deepspeed.runtime.pipe.module import PipelineModule

    from petra_ds.models.transformer import RevGPTConfig, revgpt_layers
    from petra_ds.pipeline.module import tag_muon_parameters

    model = PipelineModule(revgpt_layers(RevGPTConfig(vocab_size=50, seq_len=8, d_model=16, n_layers=2, n_heads=2)),
                           num_stages=1, partition_method="uniform")
    tag_muon_parameters(model)
    muon = sorted(n for n, p in model.named_parameters() if p.use_muon)
    assert muon == ["1.F.proj.weight", "1.F.qkv.weight", "1.G.net.1.weight", "1.G.net.3.weight",
                    "2.F.proj.weight", "2.F.qkv.weight", "2.G.net.1.weight", "2.G.net.3.weight"]


@pytest.mark.parametrize("compensation", [None, [{"method": "weight_prediction"}, {"method": "adaptive_momentum"}]],
                         ids=["muon", "prediction+adaptive"])
def test_muon_per_stage_equals_each_stage_stepping_its_own_muon(compensation):
    assert_engine_equals(MUON, compensation, muon_reference)

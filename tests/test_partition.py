"""The cost-balanced partition (petra_ds.pipeline.partition) against brute force, and through PetraPipelineModule."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import petra_ds
from petra_ds.pipeline.module import spec_is_reversible
from petra_ds.pipeline.partition import RULES, LayerCost, balanced_parts, imbalance, load_costs, stage_cost
from petra_ds.tools.toy import toy_layer_specs


def all_partitions(n: int, J: int):
    for cuts in itertools.combinations(range(1, n), J - 1):
        yield [0, *cuts, n]


def slowest(costs, parts, rule="petra"):
    J = len(parts) - 1
    return max(stage_cost(costs[a:b], j, J, rule=rule) for j, (a, b) in enumerate(zip(parts, parts[1:])))


costs_strategy = st.lists(
    st.builds(LayerCost, forward=st.floats(0.01, 1.0), forward_grad=st.floats(0.01, 1.5), backward=st.floats(0.01, 2.0),
              reconstruct=st.one_of(st.none(), st.floats(0.01, 1.5))),
    min_size=1, max_size=9)


@settings(max_examples=150, deadline=None)
@given(costs=costs_strategy, data=st.data())
def test_balanced_parts_is_optimal_against_every_partition(costs, data):
    J = data.draw(st.integers(1, len(costs)))
    rule = data.draw(st.sampled_from(RULES))
    parts = balanced_parts(costs, J, rule=rule)
    assert parts[0] == 0 and parts[-1] == len(costs) and all(a < b for a, b in zip(parts, parts[1:]))
    best = min(all_partitions(len(costs), J), key=lambda p: slowest(costs, p, rule))
    assert slowest(costs, parts, rule) == pytest.approx(slowest(costs, best, rule), rel=1e-12)


def test_stage_cost_follows_what_each_stage_runs_per_clock():
    rev = LayerCost(forward=1.0, forward_grad=1.5, backward=2.0, reconstruct=1.75)
    plain = LayerCost(forward=1.0, forward_grad=1.5, backward=2.0)
    assert stage_cost([rev, rev], 1, 3) == 2 + 3.5 + 4  # middle, all reversible: forward, reconstruct, backward
    assert stage_cost([rev, plain], 1, 3) == 2 + 3 + 4  # one layer is not reversible: recompute with a graph
    assert stage_cost([rev], 0, 3) == 1 + 1.5 + 2  # stage 0 re-reads its data and recomputes
    assert stage_cost([rev], 2, 3) == 1.5 + 2  # the last stage: forward with a graph, backward, same clock
    assert stage_cost([rev, rev], 1, 3, input_buffer="all") == 2 + 3 + 4  # inputs kept: recompute
    for stage in range(3):  # backprop: every stage's forward keeps its graph; checkpointing runs it twice
        assert stage_cost([rev, plain], stage, 3, rule="backprop") == 3 + 4
        assert stage_cost([rev, plain], stage, 3, rule="backprop_ckpt") == 3 + 3 + 4
    with pytest.raises(ValueError, match="unknown partition rule 'gpipe'; use one of petra, backprop"):
        stage_cost([rev], 0, 1, rule="gpipe")


def test_each_schedule_is_cut_by_its_own_rule():
    """PETRA's last stage is cheaper per layer (no recompute), so PETRA gives it more layers than a
    backprop pipeline, whose stages all cost forward with a graph plus backward."""
    costs = [LayerCost(1.0, 1.5, 2.0, 1.75) for _ in range(8)]
    assert balanced_parts(costs, 2) == [0, 3, 8]
    assert balanced_parts(costs, 2, rule="backprop") == [0, 4, 8]


def test_an_expensive_first_layer_gets_a_stage_of_its_own():
    """RevNet-like: a costly non-reversible stem, then cheap reversible blocks (uniform would give the stem
    company)."""
    costs = [LayerCost(3.0, 4.0, 6.0)] + [LayerCost(0.5, 0.7, 1.0, 0.8) for _ in range(7)] + [LayerCost(0.1, 0.1, 0.2)]
    parts = balanced_parts(costs, 3)
    assert parts[:2] == [0, 1]
    assert slowest(costs, parts) < slowest(costs, [0, 3, 6, 9])


def test_a_finer_grain_removes_the_whole_layer_imbalance():
    """Three equal blocks on two stages: the best cut is 1 | 2 blocks, the slowest stage 4/3 of the mean; as six
    equal halves the cut is 3 | 3, even."""
    block, half = LayerCost(0.5, 1.0, 1.0), LayerCost(0.25, 0.5, 0.5)
    parts = balanced_parts([block] * 3, 2, rule="backprop")
    assert imbalance([block] * 3, parts, rule="backprop") == pytest.approx(1 / 3)
    halves = balanced_parts([half] * 6, 2, rule="backprop")
    assert halves == [0, 3, 6] and imbalance([half] * 6, halves, rule="backprop") == pytest.approx(0.0)
    # PETRA's rule, layers of forward 1, forward with a graph 1, backward 2: stage 0 of two layers runs forward,
    # recomputation and backward (2 + 2 + 4 = 8), the last stage its forward with a graph and backward (1 + 2)
    petra = LayerCost(1.0, 1.0, 2.0)
    assert imbalance([petra] * 3, [0, 2, 3]) == pytest.approx(8 / 5.5 - 1)


def test_costs_from_a_json_file_and_bad_entries(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps([{"forward": 1.0, "forward_grad": 1.2, "backward": 2.0, "reconstruct": None},
                                {"forward": 0.5, "forward_grad": 0.6, "backward": 1.0, "reconstruct": 0.7}]))
    assert load_costs(str(path)) == [LayerCost(1.0, 1.2, 2.0), LayerCost(0.5, 0.6, 1.0, 0.7)]
    with pytest.raises(ValueError, match=r"layer cost 0 is \{'fwd': 1.0\}; give each layer"):
        load_costs([{"fwd": 1.0}])
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 non-empty stages"):
        balanced_parts(load_costs(str(path)), 3)


def toy_costs():
    """The toy model's layers with a slow stem: a balanced cut must differ from uniform."""
    return [LayerCost(1.0 if i == 0 else 0.1, 1.2 if i == 0 else 0.12, 2.0 if i == 0 else 0.2,
                      0.12 if spec_is_reversible(spec) else None) for i, spec in enumerate(toy_layer_specs())]


def test_the_module_cuts_by_cost_with_partition_method_profile(world_of_one):
    specs = toy_layer_specs()
    module = petra_ds.PetraPipelineModule(specs, num_stages=1, loss_fn=nn.CrossEntropyLoss(), stages_per_rank=4,
                                          partition_method="profile", layer_costs=toy_costs())
    assert module.petra_parts == balanced_parts(toy_costs(), 4)
    assert module.petra_parts[:2] == [0, 1]
    uniform = petra_ds.PetraPipelineModule(specs, num_stages=1, loss_fn=nn.CrossEntropyLoss(), stages_per_rank=4,
                                           partition_method="uniform")
    assert module.petra_parts != uniform.petra_parts


def test_profile_without_costs_or_with_the_wrong_count_says_what_to_pass(world_of_one):
    kwargs = {"num_stages": 1, "loss_fn": nn.CrossEntropyLoss(), "stages_per_rank": 4, "partition_method": "profile"}
    with pytest.raises(ValueError, match=r'partition_method="profile" needs layer_costs=\[...\]'):
        petra_ds.PetraPipelineModule(toy_layer_specs(), **kwargs)
    with pytest.raises(ValueError, match=r"layer_costs has 2 entries for 9 layer specs; give one per layer spec"):
        petra_ds.PetraPipelineModule(toy_layer_specs(), layer_costs=toy_costs()[:2], **kwargs)


def test_measured_costs_have_a_reconstruction_exactly_for_the_reversible_layers_and_leave_the_model_alone():
    import torch

    from petra_ds.perf.measure import measure_layer_costs
    from petra_ds.tools.toy import toy_data

    torch.manual_seed(0)
    specs = toy_layer_specs(dropout=0.0, batchnorm=True)
    layers = [spec.build() for spec in specs]
    before = {k: v.clone() for i, layer in enumerate(layers) for k, v in
              ((f"{i}.{n}", t) for n, t in layer.state_dict().items())}
    x, labels = toy_data(1, 4, dtype=torch.float32)[0]
    costs = measure_layer_costs(layers, x, loss_fn=nn.CrossEntropyLoss(), labels=labels, repeats=2)
    assert len(costs) == len(specs)
    expected = [spec_is_reversible(spec) and i < len(specs) - 1 for i, spec in enumerate(specs)]
    assert [c.reconstruct is not None for c in costs] == expected
    assert all(c.forward > 0 and c.forward_grad > 0 and c.backward > 0 for c in costs)
    after = {f"{i}.{n}": t for i, layer in enumerate(layers) for n, t in layer.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def test_partition_grain_benchmark_reports_the_best_cut_of_its_own_costs(tmp_path):
    """``python -m benchmarks.peers grain``, tiny: every row's cuts are the optimal cuts of the costs it saved, the
    block grain's costs are the sums of each block's two halves, and the clock ratio is the two slowest stages'
    ratio."""
    from benchmarks import peers

    out = tmp_path / "grain.json"
    peers.main(["grain", "--rounds", "1", "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8",
                "--vocab-size", "32", "--micro-batch-size", "2", "--stages", "2", "4", "--output", str(out)])
    report = json.loads(out.read_text())
    costs = {g: load_costs(c) for g, c in report["rounds"][0]["costs"].items()}
    assert len(costs["block"]) == 5 and len(costs["half"]) == 7
    half_a, half_b = costs["half"][1:3]
    assert costs["block"][1] == LayerCost(half_a.forward + half_b.forward, half_a.forward_grad + half_b.forward_grad,
                                          half_a.backward + half_b.backward, half_a.reconstruct + half_b.reconstruct)
    assert costs["block"][0] == costs["half"][0] and costs["block"][3:] == costs["half"][5:]
    for row in report["table"]:
        for grain in ("block", "half"):
            assert row[f"{grain}_parts"] == balanced_parts(costs[grain], row["J"])
            assert row[f"{grain}_imbalance"] == pytest.approx(imbalance(costs[grain], row[f"{grain}_parts"]))
        assert row["clock_half_over_block"] == pytest.approx(row["half_slowest_s"] / row["block_slowest_s"])

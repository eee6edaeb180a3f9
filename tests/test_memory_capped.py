"""``python -m benchmarks.memory capped``: the choice under a cap, by hand, and (slow) a tiny run of the search."""

import json
import math

import pytest

from benchmarks.lib import ckpt_split_backward
from benchmarks.lib import memory_capped as bench


def test_the_fastest_fitting_configuration_is_chosen():
    configs = {bench.label(b, p): {"micro_batch_size": b, "partition": p, "median_samples_per_s": v, "peak": peak}
               for b, p, v, peak in [(4, "default", 10.0, 100), (8, "default", 15.0, 180), (16, "default", 20.0, 300),
                                     (8, "profile", 17.0, 190)]}
    assert bench.best_under(300, configs)["micro_batch_size"] == 16
    assert bench.best_under(299, configs) == configs["8 profile"]  # the fastest no longer fits; the cut counts
    assert bench.best_under(189, configs) == configs["8"]
    assert bench.best_under(100, configs) == configs["4"]
    assert bench.best_under(99, configs) is None  # does not fit
    peer = {"8": {"micro_batch_size": 8, "median_samples_per_s": 18.0, "peak": 150}}
    both = {"petra": configs, "1f1b": peer}
    capped, free = bench.choice(189, both), bench.choice(math.inf, both)
    assert capped["fastest_peer"] == "1f1b" and capped["petra_over_fastest_peer"] == 15.0 / 18.0
    assert free["best"]["petra"] == configs["16"] and free["petra_over_fastest_peer"] == 20.0 / 18.0
    assert bench.choice(100, both)["petra_over_fastest_peer"] is None  # no peer fits
    assert [bench.label(8, "default", "half"), bench.label(8, "profile", "half")] == ["8 half", "8 profile half"]


def test_petras_compute_bound_is_its_slowest_stage_at_the_cut_and_the_best_fitting_one():
    from petra_ds.pipeline.partition import LayerCost

    stem = LayerCost(forward=1.0, forward_grad=1.2, backward=2.0)  # not reversible: recomputed from its kept input
    block = LayerCost(forward=1.0, forward_grad=1.1, backward=2.0, reconstruct=1.3)
    head = LayerCost(forward=0.5, forward_grad=1.0, backward=2.0)
    layers = [stem, block, head]
    # cut after the stem: stage 0 = 1 + 1.2 + 2 = 4.2; the last stage keeps its graph: (1.1 + 1) + (2 + 2) = 6.1
    assert bench.compute_bound(layers, 4, [0, 1, 3]) == pytest.approx(4 / 6.1)
    # cut after the block: stage 0 = (1 + 1) + (1.2 + 1.1) + (2 + 2) = 8.3; the last stage 1 + 2 = 3
    assert bench.compute_bound(layers, 4, [0, 2, 3]) == pytest.approx(4 / 8.3)
    # J = 3: stem 4.2, the block in the middle reconstructs, 1 + 1.3 + 2 = 4.3, the head 3
    assert bench.compute_bound(layers, 4, [0, 1, 2, 3]) == pytest.approx(4 / 4.3)

    slow = [LayerCost(2 * c.forward, 2 * c.forward_grad, 2 * c.backward, c.reconstruct and 2 * c.reconstruct)
            for c in layers]
    costs = {(4, "block"): [layers, slow, slow], (8, "block"): [slow, slow, slow]}
    petra = {bench.label(b, p): {"micro_batch_size": b, "partition": p, "grain": "block", "peak": peak,
                                 "median_samples_per_s": v, "parts": parts}
             for b, p, peak, v, parts in [(4, "default", 100, 0.5, [0, 2, 3]), (8, "default", 180, 0.4, [0, 2, 3]),
                                          (8, "profile", 150, 0.6, [0, 1, 3])]}
    best_cuts = bench.bounds(petra, costs, 2)
    assert petra["4"]["compute_bound"] == pytest.approx(4 / 16.6)  # the median of the rounds: a slow one
    assert petra["8"]["compute_bound"] == pytest.approx(8 / 16.6)
    assert petra["8 profile"]["compute_bound"] == pytest.approx(8 / 12.2)
    assert petra["8 profile"]["of_compute_bound"] == pytest.approx(0.6 / (8 / 12.2))
    assert best_cuts["8"]["best_cuts"] == [[0, 1, 3]] * 3 and best_cuts["4"]["compute_bound"] == pytest.approx(4 / 12.2)

    capped = bench.ceiling_under(160, petra, best_cuts, peer=0.5)  # micro-batch 8 fits with the profiled cut
    assert capped["at_cut_run"]["config"] == "8 profile"
    assert capped["at_cut_run"]["over_fastest_peer"] == pytest.approx(8 / 12.2 / 0.5)
    assert capped["at_best_cut"]["micro_batch_size"] == 8
    low = bench.ceiling_under(120, petra, best_cuts, peer=None)  # micro-batch 4 alone, at its cut and at the best
    assert low["at_cut_run"]["compute_bound"] == pytest.approx(4 / 16.6)
    assert low["at_cut_run"]["over_fastest_peer"] is None
    assert low["at_best_cut"]["compute_bound"] == pytest.approx(4 / 12.2)
    assert bench.ceiling_under(99, petra, best_cuts, peer=0.5) is None
    peer = {"4": {"micro_batch_size": 4, "median_samples_per_s": 0.5, "peak": 140}}
    assert bench.choice(160, {"petra": petra, "1f1b": peer}, best_cuts)["ceiling"] == capped
    assert "ceiling" not in bench.choice(160, {"petra": petra, "1f1b": peer})


def test_a_peer_configuration_above_every_cap_is_left_out_after_round_one_unless_its_fastest():
    rounds = {"petra": {(4, "default", "block"): [{"peak": 100, "samples_per_s": 5.0}],
                        (8, "default", "block"): [{"peak": 180, "samples_per_s": 6.0}],
                        (8, "profile", "block"): [{"peak": 500, "samples_per_s": 7.0}]},
              "1f1b": {(4, "default", "block"): [{"peak": 180, "samples_per_s": 5.0}],
                       (8, "default", "block"): [{"peak": 181, "samples_per_s": 6.0}],
                       (8, "profile", "block"): [{"peak": 120, "samples_per_s": 4.0}]},
              "torch_dualpipev": {(4, "default", "block"): [{"peak": 300, "samples_per_s": 5.0}],
                                  (8, "default", "block"): [{"peak": 400, "samples_per_s": 8.0}]}}
    caps = [(4, "default", "block"), (8, "default", "block")]  # PETRA's profiled peak is not a cap
    # 1F1B's (8, default) fits no cap but is its fastest: the choice under no cap needs all its rounds
    assert bench.above_every_cap(rounds, caps) == {("torch_dualpipev", (4, "default", "block"))}


def test_a_micro_batch_count_torch_refuses_is_not_run():
    assert "DualPipeV" in bench.refusal("torch_dualpipev", 2, 2)  # it needs k >= 2 x ranks
    assert bench.refusal("torch_dualpipev", 2, 4) is None
    assert bench.refusal("torch_zbv", 2, 2) is None
    assert bench.refusal("petra", 2, 1) is None and bench.refusal("1f1b", 2, 1) is None


def test_arguments_that_cannot_keep_the_global_batch_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--global-batch", "32", "--micro-batch-sizes", "4", "6"])
    assert "--micro-batch-sizes 6 must divide --global-batch 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--schedules", "1f1b", "1f1b_ckpt"])
    assert "--schedules must include petra" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "revnet", "--grains", "block", "half"])
    assert "--grains half needs --model revgpt" in capsys.readouterr().err


def test_a_split_backward_keeps_the_checkpointed_recomputation_until_the_weight_pass():
    """``python -m benchmarks.peers split-backward``, tiny: checkpointing lowers what is live after the forward, but
    under torch's split backward (zero-bubble schedules) the recomputed activations stay live until the weight pass,
    and the peak is far above checkpointing's with one backward pass."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4))
    x = torch.randn(256, 32)
    r = {(c, s): ckpt_split_backward.measure(layers, x, c, s) for c in (False, True) for s in (False, True)}
    assert r[True, False]["after_forward_mib"] < 0.6 * r[False, False]["after_forward_mib"]
    assert r[True, False]["peak_mib"] < 0.9 * r[False, False]["peak_mib"]
    assert r[True, True]["between_passes_mib"] > 2 * r[True, True]["after_forward_mib"]
    assert r[True, True]["peak_mib"] > 1.5 * r[True, False]["peak_mib"]


@pytest.mark.slow
def test_a_tiny_search_reports_every_configuration_and_each_cap(tmp_path):
    out = tmp_path / "capped.json"
    report = bench.main(["--stages", "2", "--global-batch", "8", "--micro-batch-sizes", "2", "4", "--schedules",
                         "petra", "1f1b_ckpt", "--partitions", "default", "profile", "--grains", "block", "half",
                         "--rounds", "2", "--calls", "1",
                         "--output", str(out), "--model-args",
                         "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--vocab-size", "64"])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    configs = saved["configs"]  # micro-batch size (and a partition other than the default) as JSON keys
    for schedule in ("petra", "1f1b_ckpt"):
        assert sorted(configs[schedule]) == ["2", "2 half", "2 profile", "2 profile half",
                                             "4", "4 half", "4 profile", "4 profile half"]
        for key, c in configs[schedule].items():
            assert key == bench.label(c["micro_batch_size"], c["partition"], c["grain"])
            assert c["peak"] > 0
            first = max(configs[schedule], key=lambda k: configs[schedule][k]["rounds_samples_per_s"][0])
            above = (schedule != "petra" and c["peak"] > max(configs["petra"][b]["peak"] for b in ("2", "4"))
                     and key != first)  # a peer's fastest in round 1 is timed every round: the no-cap choice
            assert c["above_every_cap"] == above
            assert len(c["rounds_samples_per_s"]) == (1 if above else 2)  # timed once, then left out
    fastest = max(configs["petra"].values(), key=lambda c: c["median_samples_per_s"])
    assert saved["unconstrained"]["best"]["petra"] == fastest
    assert sorted(saved["best_cuts"]) == ["2", "2 half", "4", "4 half"]
    for key, c in saved["best_cuts"].items():
        assert key == bench.label(c["micro_batch_size"], "default", c["grain"]) and len(c["best_cuts"]) == 2
    for c in configs["petra"].values():
        assert c["parts"][0] == 0 and len(c["parts"]) == 3 and c["compute_bound"] > 0
        assert c["of_compute_bound"] < 1  # an estimate, but a tiny model's clock is mostly messages and engine
    top = saved["unconstrained"]["ceiling"]
    assert top["at_best_cut"]["compute_bound"] == max(c["compute_bound"] for c in saved["best_cuts"].values())
    assert top["at_cut_run"]["compute_bound"] == max(c["compute_bound"] for c in configs["petra"].values())
    caps = saved["caps"]
    assert [row["cap"] for row in caps] == [configs["petra"]["2"]["peak"], configs["petra"]["4"]["peak"]]
    for row in caps:
        assert row["best"]["petra"]["peak"] <= row["cap"]  # PETRA fits its own cap
        peer = row["best"]["1f1b_ckpt"]
        assert peer is None or peer["peak"] <= row["cap"]

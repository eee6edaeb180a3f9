"""``python -m benchmarks.accuracy time-to-loss``: the time a curve needs to reach a loss, the argument checks, and
(slow) one tiny race under the deepspeed launcher whose report holds what the table reads. The race's speed is
measured by the benchmark, never asserted here."""

from __future__ import annotations

import json

import pytest

from benchmarks.lib import time_to_loss as bench


def test_time_to_a_loss_is_interpolated_between_evaluations():
    curve = [{"step": 20, "train_s": 10.0, "val_loss": 6.0}, {"step": 40, "train_s": 20.0, "val_loss": 5.0},
             {"step": 60, "train_s": 32.0, "val_loss": 4.0}]
    assert bench.time_to(curve, 4.5) == pytest.approx(26.0)  # halfway from 5.0 to 4.0
    assert bench.time_to(curve, 5.0) == pytest.approx(20.0)
    assert bench.time_to(curve, 7.0) == pytest.approx(10.0)  # reached at the first evaluation
    assert bench.time_to(curve, 3.9) is None
    bumpy = [{"step": 20, "train_s": 10.0, "val_loss": 5.0}, {"step": 40, "train_s": 20.0, "val_loss": 5.5},
             {"step": 60, "train_s": 30.0, "val_loss": 4.5}]
    assert bench.time_to(bumpy, 4.75) == pytest.approx(27.5)  # from the evaluation just before, not the best


def test_arguments_that_cannot_give_a_target_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--peer", "1f1b", "--eval-batches", "10"])
    assert "--eval-batches 10 must be a multiple of --micro-batches 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--peer", "1f1b", "--steps", "500", "--max-steps", "480"])
    assert "--steps must be a multiple of --eval-every and at most --max-steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--peer", "petra"])  # PETRA races a peer, not itself
    with pytest.raises(SystemExit):
        bench.parse_args(["--peer", "1f1b", "--petra-micro-batches", "16", "3"])
    assert "--petra-micro-batches 3 must divide the global batch of 16 sequences" in capsys.readouterr().err
    assert bench.parse_args(["--peer", "1f1b", "--petra-micro-batches", "4", "16"]).petra_micro_batches == [4, 16]


@pytest.mark.slow
@pytest.mark.parametrize("peer, splits", [("torch_zbv", []), ("1f1b", ["4", "16"])])
def test_a_tiny_race_reports_both_curves_and_the_time_ratio(tmp_path, peer, splits):
    from benchmarks.lib import torch_pipe

    reason = torch_pipe.unsupported(peer, 2, "gloo") if peer in torch_pipe.VARIANTS else None
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "ttl.json"
    report = bench.main(["--peer", peer, "--steps", "4", "--max-steps", "8", "--eval-every", "2", "--eval-batches", "4",
                         "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--vocab-size", "300",
                         "--corpus-chars", "200000", "--warmup-steps", "2", "--output", str(out),
                         *(["--petra-micro-batches", *splits] if splits else [])])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "ttl.png").stat().st_size > 0
    runs = report["runs"]
    peer_curve = runs[peer]["curve"]
    assert [p["step"] for p in peer_curve] == [2, 4]
    assert report["target_val_loss"] == peer_curve[-1]["val_loss"]
    assert runs[peer]["steps_to_target"] <= 4
    names = ["petra (weight_prediction, k = 4, micro-batch 4)", "petra (weight_prediction, k = 16, micro-batch 1)"]
    assert list(runs) == [peer, *(names if splits else ["petra (weight_prediction)"])]
    for name in list(runs)[1:]:
        check_petra_race(report, runs[name], peer)
    assert report["petra_time_over_peer"] == runs[list(runs)[1]]["time_over_peer"]  # the first PETRA race's
    assert all(p["train_s"] > 0 for run in runs.values() for p in run["curve"])
    for run in runs.values():  # every rank's peak over one more step, by the allocator's counter
        assert [r["source"] for r in run["peak_allocated"]] == ["AllocatedStorages"] * 2
        assert run["peak"] == max(r["peak"] for r in run["peak_allocated"]) > 0
    assert "peer_fits" not in runs[peer]
    assert all(run["peer_fits"] == (runs[peer]["peak"] <= run["peak"]) for run in list(runs.values())[1:])


def check_petra_race(report: dict, petra: dict, peer: str) -> None:
    runs = report["runs"]
    steps = [p["step"] for p in petra["curve"]]
    assert steps == list(range(2, steps[-1] + 1, 2)) and steps[-1] <= 8
    reached = [p for p in petra["curve"] if p["val_loss"] <= report["target_val_loss"]]
    assert (petra["steps_to_target"] is None) == (not reached)
    assert reached in ([], [petra["curve"][-1]])  # it stops at the first evaluation that reaches the target
    if petra["seconds_to_target"] is not None:
        assert petra["time_over_peer"] == pytest.approx(petra["seconds_to_target"] / runs[peer]["seconds_to_target"])
    else:
        assert petra["time_over_peer"] is None

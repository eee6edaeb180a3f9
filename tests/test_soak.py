"""Under load it keeps working: the soak benchmark's (python -m benchmarks.soak) 2-process J = 4 RevGPT, 2,000
clocks with a checkpoint every 50 steps. After the warm-up (100 steps) the engine's holdings do not grow at all,
the resident memory grows by at most 16 MiB (allocator noise; a leak of one micro-batch per step would be ~25 MiB),
and no stage ever holds more messages between two clocks than the schedule allows."""

import os

import pytest

from petra_ds.tools.spawn import launch

from benchmarks.lib import soak

RSS_GROWTH_BOUND = 16 * 2**20


@pytest.mark.slow
def test_two_thousand_clocks_hold_steady(tmp_path):
    calls, warmup = 500, 100
    ranks = launch({"calls": calls, "save_every": 50, "out": str(tmp_path)}, 2, timeout=3000, target=soak.soak)
    for rank, v in soak.verdict(ranks, warmup).items():
        assert v["clocks"] >= 2000, v
        assert v["held_bytes_late_max"] <= v["held_bytes_early_max"], (rank, v)
        assert v["rss_late_max"] - v["rss_early_max"] <= RSS_GROWTH_BOUND, (rank, v)
        assert 0 < v["most_messages"] <= soak.MESSAGE_BOUND, (rank, v)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["global_step450", "global_step500", "latest"]

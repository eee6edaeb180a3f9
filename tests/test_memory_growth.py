"""benchmarks/memory_growth.py: its summary of a rank list, and (slow) a tiny run whose report holds every
rank's allocator peak for every (J, sequence length) and schedule."""

import json

import pytest

from subprocess_env import load_benchmark


def test_the_summary_is_the_largest_rank_and_the_middle_ranks_median():
    bench = load_benchmark("memory_growth")
    mib = bench.MIB
    ranks = [{"peak": 5 * mib}, {"peak": 2 * mib}, {"peak": 4 * mib}, {"peak": 3 * mib}]
    assert bench.summarize(ranks) == {"max": 5.0, "middle": 3.0, "ranks": [5.0, 2.0, 4.0, 3.0]}
    assert bench.summarize(ranks[:2])["middle"] == 3.5  # no middle rank: the median of all


@pytest.mark.slow
def test_a_tiny_run_reports_every_rank_of_every_cell(tmp_path):
    bench = load_benchmark("memory_growth")
    out = tmp_path / "growth.json"
    report = bench.main(["--stages", "2", "3", "--seq-lens", "16", "--variants", "petra", "1f1b",
                         "--d-model", "16", "--heads", "2", "--vocab-size", "64", "--output", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "growth.png").stat().st_size > 0
    assert [(row["J"], row["seq_len"], row["k"]) for row in report["rows"]] == [(2, 16, 4), (3, 16, 6)]
    for row in report["rows"]:
        for variant in ("petra", "1f1b"):
            ranks = row["per_rank"][variant]
            assert len(ranks) == row["J"] and all(r["source"] == "AllocatedStorages" for r in ranks)
            assert all(sum(r["parts"].values()) == r["peak"] > r["parts"]["parameters"] > 0 for r in ranks)
            assert row["variants"][variant] == bench.summarize(ranks)

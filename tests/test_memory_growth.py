"""``python -m benchmarks.memory growth``: its summary of a rank list, and (slow) a tiny run whose report holds every
rank's allocator peak for every (J, sequence length) and schedule."""

import json

import pytest

from benchmarks.lib import memory_growth as bench


def test_the_summary_is_the_largest_rank_and_the_middle_ranks_median():
    mib = bench.MIB
    ranks = [{"peak": 5 * mib}, {"peak": 2 * mib}, {"peak": 4 * mib}, {"peak": 3 * mib}]
    assert bench.summarize(ranks) == {"max": 5.0, "middle": 3.0, "ranks": [5.0, 2.0, 4.0, 3.0]}
    assert bench.summarize(ranks[:2])["middle"] == 3.5  # no middle rank: the median of all


@pytest.mark.slow
def test_a_tiny_run_reports_every_rank_of_every_cell(tmp_path):
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


def test_the_memory_model_recovers_its_own_numbers_and_predicts_deeper_pipelines(tmp_path):
    """A report made by the model itself (1F1B and PETRA, J = 2, 4, 8): the fit finds its bytes per held micro-batch
    and its constants again, the deepest J predicted from the shallower ones alone is exact, and J = 18 is the
    model's own formula: 1F1B's first rank grows by 17 held micro-batches over J = 1, PETRA's reversible ranks not."""
    mib = bench.MIB
    static = {"first": 7 * mib, "middle": 6 * mib, "last": 7 * mib}
    constant = {"first": 3 * mib, "middle": 5 * mib, "last": 9 * mib}
    per_held = {"1f1b": 2 * mib, "petra": 0.25 * mib}

    def rank(variant, r, J, count):
        role = bench.role(r, J)
        other = per_held[variant] * count + constant[role]
        parts = {"parameters": static[role] / 4, "gradients": static[role] / 4, "optimizer_state": static[role] / 2,
                 "other": other}
        return {"peak": sum(parts.values()), "parts": parts}

    rows = []
    for J in (2, 4, 8):
        per_rank = {v: [rank(v, r, J, n) for r, n in enumerate(bench.held(v, J))] for v in per_held}
        rows.append({"J": J, "seq_len": 64, "per_rank": per_rank,
                     "variants": {v: bench.summarize(ranks) for v, ranks in per_rank.items()}})
    report = {"args": {"variants": ["1f1b", "petra"], "seq_lens": [64]}, "rows": rows}
    out = bench.predictions(report, [18])
    for variant in per_held:
        cell = out[variant]["64"]
        assert cell["model"]["per_held"] == pytest.approx(per_held[variant])
        assert cell["model"]["constant"] == pytest.approx(constant) and cell["model"]["static"] == pytest.approx(static)
        assert cell["held_out"]["J"] == 8 and cell["held_out"]["error"] == pytest.approx(0, abs=1e-9)
    first_1f1b = static["first"] + constant["first"] + per_held["1f1b"] * 18
    assert out["1f1b"]["64"]["at"]["18"]["max"] == pytest.approx(first_1f1b / mib)
    assert bench.held("1f1b", 18)[0] == 18 and bench.held("petra", 18)[1:-1] == (0,) * 16
    assert out["petra"]["64"]["at"]["18"]["middle"] == pytest.approx((static["middle"] + constant["middle"]) / mib)
    saved, out_file = tmp_path / "measured.json", tmp_path / "predicted.json"
    saved.write_text(json.dumps(report))
    again = bench.main(["--from-report", str(saved), "--predict", "18", "--output", str(out_file)])
    assert json.loads(out_file.read_text())["predictions"] == json.loads(json.dumps(again["predictions"]))
    assert again["predictions"]["1f1b"]["64"]["at"]["18"]["max"] == pytest.approx(first_1f1b / mib)
    assert (tmp_path / "predicted.png").stat().st_size > 0

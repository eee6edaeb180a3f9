"""``python -m benchmarks.host_overhead --parts instructions``: host instructions per ``train_batch``, counted by
callgrind in windows that the benchmark marks with a libc call."""

import shutil

import pytest

from benchmarks.lib import host_instructions, host_overhead


def test_a_window_runs_once_inside_the_mark_and_rounds_rotate_the_variants():
    ran = []
    order = host_overhead.interleaved(["a", "b", "c"], rounds=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    host_instructions.windows({"a": lambda: ran.append("a"), "b": lambda: ran.append("b"),
                               "c": lambda: ran.append("c")}, order, per_window=2)
    assert ran == [name for name in order for _ in range(2)]


def test_the_nth_dump_is_the_nth_window(tmp_path):
    for n, total in ((2, 600), (10, 900), (1, 300)):  # numbered dumps, read in number order (10 after 2)
        (tmp_path / f"cg.77.{n}").write_text(f"# callgrind format\nevents: Ir\nsummary: 0\ntotals: {total}\n"
                                             if n == 1 else f"events: Ir\nsummary: {total}\n")
    (tmp_path / "cg.77").write_text("events: Ir\nsummary: 5\n")  # the final dump at exit: outside every window
    totals = host_instructions.dump_totals(str(tmp_path))
    assert totals == [300, 600, 900]
    assert host_instructions.per_call(["x", "y", "x"], totals, per_window=3) == {"x": [100.0, 300.0], "y": [200.0]}
    with pytest.raises(RuntimeError, match="entered closure_fcn"):
        host_instructions.per_call(["x", "y"], totals, per_window=3)


def test_the_summary_names_petras_ratios():
    counts = {"petra": [140.0, 150.0, 160.0], "deepspeed_1f1b_one_stage": [100.0], "torch_1f1b_one_stage": [125.0],
              "plain": [75.0], "plain_and_petra_forwards": [110.0], "petra_structure": [120.0],
              "petra_unchecked": [130.0]}
    s = host_instructions.summarize(counts, J=4, k=4)
    assert s["petra/deepspeed"] == pytest.approx(1.5) and s["petra/torch"] == pytest.approx(1.2)
    assert s["petra/plain"] == pytest.approx(2.0) and s["arithmetic_floor/deepspeed"] == pytest.approx(1.1)
    assert s["structure/deepspeed"] == pytest.approx(1.2) and s["unchecked/deepspeed"] == pytest.approx(1.3)
    assert s["spread"]["petra"] == pytest.approx(20 / 150)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind's callgrind")
def test_callgrind_counts_every_variant_and_petra_costs_more_than_plain():
    args = host_overhead.parse_args(["--tiny", "--parts", "instructions", "--instruction-rounds", "2",
                                     "--calls", "1"])
    report = host_overhead.count_instructions(args)
    counts = report["instructions_per_call"]
    assert set(counts) == {"petra", "deepspeed_1f1b_one_stage", "torch_1f1b_one_stage", "plain",
                           "plain_and_petra_forwards", "petra_structure", "petra_unchecked"}
    assert all(len(v) == 2 for v in counts.values())
    # the windows hold the calls and nothing of the imports: a negligible train_batch is millions of instructions,
    # an import of torch billions; plain backprop is the cheapest, PETRA's machinery more
    assert all(1e6 < c < 1e9 for v in counts.values() for c in v)
    assert report["petra/plain"] > 1 and report["median_per_call"]["plain"] < report["median_per_call"]["petra"]
    assert max(report["spread"].values()) < 0.05

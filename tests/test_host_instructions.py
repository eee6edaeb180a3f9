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
    totals = [counts["Ir"] for counts in host_instructions.dump_totals(str(tmp_path))]
    assert totals == [300, 600, 900]
    assert host_instructions.per_call(["x", "y", "x"], totals, per_window=3) == {"x": [100.0, 300.0], "y": [200.0]}
    with pytest.raises(RuntimeError, match="entered closure_fcn"):
        host_instructions.per_call(["x", "y"], totals, per_window=3)


def test_a_dump_with_the_cache_simulation_gives_its_last_level_misses(tmp_path):
    events = "events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\n"
    (tmp_path / "cg.5.1").write_text(events + "summary: 1000 400 200 30 20 10 6 5 4\n")
    (tmp_path / "cg.5.2").write_text(events + "totals: 2000 800 400 60 40 20 12\n")  # trailing zeros left out
    first, second = host_instructions.dump_totals(str(tmp_path))
    assert first["Ir"] == 1000 and host_instructions.misses(first) == 15
    assert "DLmw" not in second and host_instructions.misses(second) == 12


def test_time_is_fitted_as_a_price_per_instruction_and_per_miss():
    names = ["petra", "deepspeed_1f1b_one_stage", "petra_structure", "plain"]
    instructions = dict(zip(names, (120e6, 100e6, 110e6, 85e6)))
    missed = dict(zip(names, (330e3, 210e3, 240e3, 200e3)))
    seconds = {n: 0.1e-9 * instructions[n] + 50e-9 * missed[n] for n in names}
    fit = host_instructions.cost_fit({**seconds, "only_timed": 1.0}, instructions, missed)
    assert fit["seconds_per_instruction"] == pytest.approx(0.1e-9) and fit["seconds_per_miss"] == pytest.approx(50e-9)
    assert fit["largest_misfit"] == pytest.approx(0, abs=1e-9) and "only_timed" not in fit["fitted_seconds_per_call"]
    excess = fit["petra_over_deepspeed"]
    assert excess["instructions_seconds"] == pytest.approx(2e-3) and excess["misses_seconds"] == pytest.approx(6e-3)
    assert excess["instructions_seconds"] + excess["misses_seconds"] == pytest.approx(excess["seconds"])
    assert fit["petra_over_structure"]["misses_seconds"] == pytest.approx(4.5e-3)


def test_the_summary_names_petras_ratios():
    counts = {"petra": [140.0, 150.0, 160.0], "deepspeed_1f1b_one_stage": [100.0], "torch_1f1b_one_stage": [125.0],
              "plain": [75.0], "plain_and_petra_forwards": [110.0], "petra_structure": [120.0],
              "petra_unchecked": [130.0]}
    s = host_instructions.summarize(counts, J=4, k=4, missed={name: [2 * v[0]] for name, v in counts.items()})
    assert s["petra/deepspeed"] == pytest.approx(1.5) and s["petra/torch"] == pytest.approx(1.2)
    assert s["last_level"]["petra/deepspeed"] == pytest.approx(1.4)  # from the first window of each: 280 / 200
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
    missed = report["last_level"]["median_misses_per_call"]  # a window misses something, and less than it executes
    assert all(0 < missed[name] < report["median_per_call"][name] for name in counts)

"""The run layout fitted to the launched processes (petra_ds.tools.runs.choose_layout), and CIFAR-10's message
when its files are missing offline."""

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from petra_ds.tools.runs import Layout, choose_layout
from subprocess_env import ROOT, launcher_env


def layout(ranks: int, replicas: int, per_rank: int, layers: int) -> Layout:
    return Layout(pipeline_ranks=ranks, data_parallel=replicas, stages_per_rank=per_rank, stages=ranks * per_rank,
                  layers=layers)


@pytest.mark.parametrize("layers,world,stages,data_parallel,expected", [
    (10, 18, None, None, layout(9, 2, 1, 10)),   # RevNet18 on 18 processes: J = 9, two blocks on one stage
    (18, 18, None, None, layout(18, 1, 1, 18)),  # RevNet34 on 18: one stage per block
    (11, 4, None, None, layout(4, 1, 2, 11)),    # default RevGPT on 4: J = 8
    (11, 1, None, None, layout(1, 1, 11, 11)),   # one process hosts every layer as its own stage
    (9, 1, None, None, layout(1, 1, 9, 9)),      # the quickstart's toy model, plain python
    (9, 4, None, None, layout(4, 1, 2, 9)),      # ... and on 4 processes
    (10, 2, None, None, layout(2, 1, 5, 10)),    # the README's digits run: unchanged
    (10, 7, None, None, layout(7, 1, 1, 10)),    # a prime world
    (3, 8, None, None, layout(2, 4, 1, 3)),      # more processes than layers: replicas
    (10, 1, 4, None, layout(1, 1, 4, 10)),
    (5, 2, 4, None, layout(2, 1, 2, 5)),         # the tests' --stages 4 on 2 processes: unchanged
    (10, 18, 7, None, layout(1, 18, 7, 10)),     # only one rank divides 7
    (10, 18, 6, None, layout(6, 3, 1, 10)),
    (10, 4, None, 2, layout(2, 2, 5, 10)),
    (11, 6, None, 2, layout(3, 2, 3, 11)),
    (10, 4, 4, 2, layout(2, 2, 2, 10)),
    (10, 2, 10, 1, layout(2, 1, 5, 10)),         # both explicit, as the scripts' old defaults
])
def test_layout_table(layers, world, stages, data_parallel, expected):
    assert choose_layout(layers, world, stages, data_parallel) == expected


def test_the_layout_describes_itself_in_one_line():
    assert choose_layout(10, 18).describe() == ("layout: 18 processes = 9 pipeline ranks x 2 data-parallel replicas; "
                                                "J = 9 PETRA stages (1 per rank) over 10 layers")
    assert choose_layout(9, 1).describe() == ("layout: 1 process = 1 pipeline rank x 1 data-parallel replica; "
                                              "J = 9 PETRA stages (9 per rank) over 9 layers")
    one_f_one_b = choose_layout(10, 4, petra=False)
    assert one_f_one_b == Layout(4, 1, 1, 4, 10, petra=False)
    assert one_f_one_b.describe().endswith("DeepSpeed 1F1B, one stage per pipeline rank over 10 layers")


def test_the_topology_is_pipe_by_data():
    topology = choose_layout(10, 18).topology()
    assert topology.get_dim("pipe") == 9 and topology.get_dim("data") == 2


@pytest.mark.parametrize("layers,world,stages,data_parallel,petra,message", [
    (10, 18, 11, None, True, r"--stages 11 is more than the 10 layers .* use --stages 10 or fewer"),
    (10, 18, None, 4, True, r"--data-parallel 4 does not divide the 18 processes of this run; use one of "
                            r"\[1, 2, 3, 6, 9, 18\]"),
    (10, 18, None, 1, True, r"--data-parallel 1 leaves 18 / 1 = 18 pipeline ranks for 10 layers: .* use "
                            r"--data-parallel 2 or another of \[2, 3, 6, 9, 18\]"),
    (10, 18, 4, 2, True, r"--stages 4 must be a multiple of the 9 pipeline ranks \(18 processes / --data-parallel 2\): "
                         r"use --stages in \[9\], or leave --data-parallel out"),
    (10, 2, 3, 1, True, r"--stages 3 must be a multiple of the 2 pipeline ranks .* use --stages in \[2, 4, 6, 8, 10\]"),
    (10, 18, None, 1, False, r"--data-parallel 1 leaves 18 / 1 = 18 pipeline ranks for 10 layers"),
    (10, 2, 4, None, False, r"--stages 4 sets PETRA's number of stages J, but a config without a \"petra\" section "
                            r"runs DeepSpeed's 1F1B"),
    (10, 2, 0, None, True, r"--stages must be an integer >= 1, got 0"),
    (10, 0, None, None, True, r"the number of processes must be an integer >= 1, got 0"),
])
def test_an_impossible_request_names_the_fix(layers, world, stages, data_parallel, petra, message):
    with pytest.raises(ValueError, match=message):
        choose_layout(layers, world, stages, data_parallel, petra=petra)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check(result: Layout, layers: int, world: int) -> None:
    assert result.pipeline_ranks * result.data_parallel == world
    assert result.stages == result.pipeline_ranks * result.stages_per_rank
    assert result.pipeline_ranks <= result.stages <= layers and result.layers == layers


@given(st.integers(1, 64), st.integers(1, 96))
def test_automatic_layouts_fit_with_the_fewest_replicas(layers, world):
    result = choose_layout(layers, world)
    check(result, layers, world)
    assert all(world // d > layers for d in divisors(world) if d < result.data_parallel)
    assert result.stages > layers - result.pipeline_ranks  # S = floor(L / P): fewer than P layers left over
    assert result.stages_per_rank == layers // result.pipeline_ranks
    assert choose_layout(layers, world, petra=False) == Layout(result.pipeline_ranks, result.data_parallel, 1,
                                                              result.pipeline_ranks, layers, petra=False)


@given(st.data(), st.integers(1, 64), st.integers(1, 96))
def test_explicit_stages_keep_j_with_the_fewest_replicas(data, layers, world):
    stages = data.draw(st.integers(1, layers))
    result = choose_layout(layers, world, stages)
    check(result, layers, world)
    assert result.stages == stages
    assert all(stages % (world // d) for d in divisors(world) if d < result.data_parallel)


@given(st.data(), st.integers(1, 64), st.integers(1, 96))
def test_explicit_data_parallel_is_kept_or_refused(data, layers, world):
    replicas = data.draw(st.integers(1, world + 2))
    if world % replicas or world // replicas > layers:
        with pytest.raises(ValueError, match="--data-parallel"):
            choose_layout(layers, world, data_parallel=replicas)
        return
    result = choose_layout(layers, world, data_parallel=replicas)
    check(result, layers, world)
    assert result.data_parallel == replicas and result.stages_per_rank == layers // result.pipeline_ranks


def test_cifar10_missing_offline_names_download_and_data_dir(tmp_path):
    from petra_ds.data.vision import DatasetNotFoundError, build_dataset

    with pytest.raises(DatasetNotFoundError) as caught:
        build_dataset("cifar10", str(tmp_path), train=True, download=False)
    message = str(caught.value)
    assert isinstance(caught.value, FileNotFoundError)
    assert str(tmp_path / "cifar-10-batches-py") in message and "data_batch_1" in message
    assert "--download" in message and "--data-dir DIR" in message and "--dataset digits" in message
    assert "download=True" not in message


def test_the_revnet_example_exits_cleanly_without_cifar10(tmp_path):
    """The default data set, offline and not on disk: the message, no traceback, before any training."""
    script = os.path.join(ROOT, "examples", "revnet", "train.py")
    cmd = [sys.executable, script, "--deepspeed_config", os.path.join(ROOT, "ds_configs", "petra.json"),
           "--data-dir", str(tmp_path / "data"), "--output-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "layout: 1 process = 1 pipeline rank x 1 data-parallel replica; J = 10 PETRA stages" in proc.stdout
    assert "--download" in proc.stderr and "--data-dir DIR" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("global_batch, replicas, stages, micro_batches, expected", [
    (16, 1, 4, None, (2, 8)),    # k >= 2 (J - 1) = 6: the smallest divisor of 16 that is, 8
    (16, 1, 8, None, (1, 16)),   # k >= 14: 16
    (16, 2, 2, None, (4, 2)),    # 8 per replica, k >= 2
    (16, 1, 1, None, (16, 1)),   # one stage, no delay: one micro-batch
    (12, 1, 8, None, (1, 12)),   # no divisor reaches 14: every sample its own micro-batch
    (16, 1, 4, 4, (4, 4)),       # k given
])
def test_a_global_batch_is_split_so_the_first_stage_is_at_most_a_step_behind(global_batch, replicas, stages,
                                                                               micro_batches, expected):
    from petra_ds.tools.runs import split_global_batch

    assert split_global_batch(global_batch, replicas, stages, micro_batches) == expected


@pytest.mark.parametrize("args, message", [((15, 2, 4, None), "does not divide over 2 data-parallel replicas"),
                                           ((16, 1, 4, 3), "--micro-batches 3 does not divide the 16 samples"),
                                           ((0, 1, 4, None), "--global-batch must be an integer >= 1")])
def test_a_global_batch_that_cannot_be_split_names_the_fix(args, message):
    from petra_ds.tools.runs import split_global_batch

    with pytest.raises(ValueError, match=message):
        split_global_batch(*args)


@pytest.mark.parametrize("stages, micro_batches, split_for_depth, expected, says", [
    (4, None, True, (2, 8), "k = 4 would leave stage 0 1.5 optimizer steps behind at J = 4"),
    (2, None, True, (4, 4), None),           # k = 4 >= 2(J-1) = 2: the config's split stands
    (4, 4, True, (4, 4), "--micro-batches"),  # the config's split, asked for
    (4, 16, True, (1, 16), "--micro-batches"),
    (4, None, False, (4, 4), None),          # the vision example and backprop keep the config's split
])
def test_the_lm_examples_petra_splits_the_configs_global_batch_for_the_depth(capsys, stages, micro_batches,
                                                                              split_for_depth, expected, says):
    import argparse

    from petra_ds.tools.runs import Layout, apply_global_batch

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
    args = argparse.Namespace(global_batch=None, micro_batches=micro_batches)
    apply_global_batch(args, config, Layout(1, 1, stages, stages, 11), split_for_depth=split_for_depth)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == expected
    printed = capsys.readouterr().out
    if says is None:
        assert printed == ""
    else:
        assert f"the config's global batch of 16 (micro-batch 4 x k = 4) is split as micro-batch {expected[0]} x k = " \
               f"{expected[1]} ({says}; --micro-batches 4 keeps the config's split)" in printed


def test_micro_batches_alone_is_refused_where_it_splits_nothing():
    import argparse

    from petra_ds.tools.runs import Layout, apply_global_batch

    with pytest.raises(SystemExit, match="give --global-batch too"):
        apply_global_batch(argparse.Namespace(global_batch=None, micro_batches=8),
                           {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
                           Layout(1, 1, 4, 4, 11))

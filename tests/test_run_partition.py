"""petra_ds.tools.run_partition in one process: the shared costs file, the agreement check, the atomic write."""

import json
import os

import pytest
import torch
from torch import nn

from petra_ds.runtime import checkpoint
from petra_ds.pipeline.partition import LayerCost, load_costs, save_costs
from petra_ds.tools.run_partition import COSTS_FILE, agreed_partition, shared_layer_costs
from petra_ds.tools.toy import toy_data, toy_layer_specs


def _micro_batch():
    (x, y), = toy_data(1, 4, 0, torch.float32)
    return x, y


def test_rank_0_measures_into_one_file_and_leaves_the_random_streams_alone(world_of_one, tmp_path):
    specs = toy_layer_specs(dropout=0.1)
    state = torch.get_rng_state()
    costs, path = shared_layer_costs(specs, _micro_batch, nn.CrossEntropyLoss(), str(tmp_path / "run"))
    assert torch.equal(torch.get_rng_state(), state)
    assert path == str(tmp_path / "run" / COSTS_FILE) and os.listdir(tmp_path / "run") == [COSTS_FILE]
    assert costs == load_costs(path) and len(costs) == len(specs)
    # a resumed run keeps the file its first run wrote (its stages match its checkpoint); a new one measures
    kept = [LayerCost(1.0, 1.0, 1.0)] * len(specs)
    save_costs(kept, path)
    assert shared_layer_costs(specs, _micro_batch, nn.CrossEntropyLoss(), str(tmp_path / "run"),
                              keep_existing=True) == (kept, path)
    assert shared_layer_costs(specs, _micro_batch, nn.CrossEntropyLoss(), str(tmp_path / "run"))[0] != kept


def test_an_earlier_costs_file_is_read_as_it_is_and_a_missing_one_is_named(world_of_one, tmp_path):
    def never():
        raise AssertionError("nothing is measured when a costs file is given")

    path = str(tmp_path / "earlier.json")
    save_costs([LayerCost(1.0, 2.0, 3.0)], path)
    assert shared_layer_costs([], never, None, str(tmp_path / "run"), reuse=path) == (load_costs(path), path)
    with pytest.raises(FileNotFoundError, match=f"rank 0 finds no layer costs file {tmp_path}/missing.json$"):
        shared_layer_costs([], never, None, str(tmp_path / "run"), reuse=str(tmp_path / "missing.json"))


def test_ranks_that_cut_differently_are_refused(world_of_one, monkeypatch):
    from deepspeed import comm

    class Module:
        parts = [0, 2, 4]

    assert agreed_partition(Module(), "uniform") == {"method": "uniform", "parts": [0, 2, 4], "layer_costs": None}

    def other_rank_cut_elsewhere(out, obj, group=None):
        out[:] = [obj, [0, 1, 4]]

    monkeypatch.setattr(comm, "all_gather_object", other_rank_cut_elsewhere)
    with pytest.raises(RuntimeError, match=r"different stages \(rank 0: \[0, 2, 4\]; rank 1: \[0, 1, 4\]\)"):
        agreed_partition(Module(), "profile", "costs.json")


def test_a_failed_write_leaves_the_previous_costs_file_whole(tmp_path, monkeypatch):
    path = str(tmp_path / COSTS_FILE)
    save_costs([LayerCost(1.0, 2.0, 3.0)], path)
    before = open(path).read()

    def disk_full(fd):
        raise OSError("no space left on device")

    monkeypatch.setattr(checkpoint.os, "fsync", disk_full)
    with pytest.raises(OSError, match="no space left"):
        save_costs([LayerCost(4.0, 5.0, 6.0, 7.0)] * 3, path)
    assert open(path).read() == before and json.loads(before)[0]["forward"] == 1.0


def test_a_costs_file_without_the_profile_partition_is_refused():
    import argparse

    from petra_ds.tools.runs import add_run_arguments, apply_run_arguments

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    with pytest.raises(SystemExit, match="--layer-costs gives the costs --partition profile cuts from"):
        apply_run_arguments(parser.parse_args(["--layer-costs", "costs.json"]), {"petra": {}})
    assert apply_run_arguments(parser.parse_args(["--layer-costs", "costs.json", "--partition", "profile"]), {}) \
        == "backprop"


def test_the_module_cuts_for_the_engines_input_buffer(world_of_one):
    """A reversible middle stage that keeps its inputs ("all") recomputes instead of reconstructing, so
    with a cheap reconstruction and a costly recompute the balanced cut moves."""
    import petra_ds
    from petra_ds.pipeline.module import spec_is_reversible
    from petra_ds.pipeline.partition import balanced_parts

    specs = toy_layer_specs()
    costs = [LayerCost(1.0, 3.0, 1.0, 0.1) if spec_is_reversible(s) else LayerCost(1.0, 1.0, 1.0) for s in specs]
    assert balanced_parts(costs, 4) != balanced_parts(costs, 4, "all")
    for input_buffer in ("non_reversible", "all"):
        module = petra_ds.PetraPipelineModule(specs, num_stages=1, loss_fn=nn.CrossEntropyLoss(), stages_per_rank=4,
                                              partition_method="profile", layer_costs=costs, input_buffer=input_buffer)
        assert module.petra_parts == balanced_parts(costs, 4, input_buffer)

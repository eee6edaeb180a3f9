"""Communication recorded from real CPU runs (gloo), replayed under NCCL's rules (docs/design/nccl.md).

Every rank of each run writes its issue order (``PETRA_DS_COMM_TRACE``); :func:`replay_nccl` plays the
ranks against each other with one in-order queue per rank, tags ignored and the first-call rule, and
fails on the first hang. The runs cover 2, 3 and 4 ranks, stages_per_rank 1 and 2, data parallelism,
tied embeddings, ``drain``, ``synchronous_steps``, ``eval_batch``, the gradient-quality probe and a save / load
mid-flight.
The negative control (the old posting, reported as a hang) is in ``test_nccl_replay.py``.
"""

import pytest

from petra_ds.verify.nccl_replay import load_traces, main, replay_nccl
from petra_ds.runtime.transport import TRACE_ENV

from harness import launch

SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


def traced(tmp_path, name: str, **spec) -> tuple[list[dict], dict[int, list[dict]]]:
    """Run ``spec`` with every rank recording its communication; (results, traces)."""
    directory = tmp_path / name
    results = launch({"optimizer": SGD, "env": {TRACE_ENV: str(directory)}, **spec})
    return results, load_traces(directory)


def collectives(traces: dict[int, list[dict]]) -> set[str]:
    return {e["kind"] for events in traces.values() for e in events if e["op"] == "collective"}


def channels(traces: dict[int, list[dict]]) -> set[str]:
    return {op["channel"].split(":")[0] for events in traces.values() for e in events if e["op"] == "batch"
            for op in e["ops"]}


def test_two_ranks_probe_eval_save_then_load_mid_flight(tmp_path):
    """J = 4 on 2 ranks (stages_per_rank 2): training with the gradient-quality probe, evaluation after
    every call, a checkpoint taken mid-flight, the drain; then fresh processes load it and go on."""
    save = str(tmp_path / "ckpt")
    common = dict(pipe=2, stages_per_rank=2, k=2, train_batches=4, dropout=0.1)
    _, first = traced(tmp_path, "first", **common, petra={"gradient_quality_every": 1}, eval_every=1,
                      save_dir=save, save_after=2, drain=False)
    report = replay_nccl(first)
    assert report.transfers > 0 and set(report.batches) == {0, 1}
    assert {"act", "grad", "gq_act", "gq_grad", "eval"} <= channels(first)
    assert {"barrier", "broadcast", "all_gather_object"} <= collectives(first)
    _, resumed = traced(tmp_path, "resumed", **common, load_dir=save, eval_batches=1)
    replay_nccl(resumed)
    assert {"act", "grad", "eval"} <= channels(resumed)


def test_a_background_checkpoint_records_its_collectives(tmp_path):
    """With ``async_save`` the save's barriers come at the save and when the run waits for the write: both are in
    the trace of a run that ends with that wait, and the replay finds every rank issuing them in one order."""
    _, traces = traced(tmp_path, "async", pipe=2, stages_per_rank=2, k=2, train_batches=3, dropout=0.1,
                       petra={"async_save": True}, save_dir=str(tmp_path / "ckpt"), save_after=2, drain=False,
                       eval_batches=0)
    replay_nccl(traces)
    for events in traces.values():
        whats = [e["what"] for e in events if e["op"] == "collective" and e["kind"] == "barrier"]
        assert whats[-3:] == ["save_checkpoint: the directory is prepared",
                              "background checkpoint: every rank wrote its files", "background checkpoint: committed"]


def test_three_ranks_one_stage_each_with_drain_and_eval(tmp_path):
    _, traces = traced(tmp_path, "three", pipe=3, stages_per_rank=1, k=3, train_batches=3, dropout=0.1,
                       eval_batches=1)
    report = replay_nccl(traces)
    assert set(report.batches) == {0, 1, 2} and all(report.batches[r] > 0 for r in range(3))
    # the middle rank exchanges with both neighbours, one batch per clock and phase
    whats = {e["what"].split(" of clock")[0] for e in traces[1] if e["op"] == "batch"}
    assert {"the act batch", "the grad batch"} <= whats
    assert main([str(tmp_path / "three")]) == 0  # the command line README gives users


def test_three_ranks_synchronous_steps_then_petra(tmp_path):
    """Two calls that fill and drain (``synchronous_steps``), then one of PETRA's and the final drain."""
    results, traces = traced(tmp_path, "sync", pipe=3, stages_per_rank=1, k=2, train_batches=3, dropout=0.1,
                             petra={"synchronous_steps": 2})
    replay_nccl(traces)
    assert all(r["clock"] == 2 * (2 + 4) + 2 + 4 for r in results)


def test_four_ranks_data_parallel_pipeline_with_tied_embeddings(tmp_path):
    """2 data-parallel replicas x 2 pipeline ranks x 2 stages per rank (J = 4) of a RevGPT whose embedding
    and output layer share weights across stages: data-parallel all-reduces inside each stage's group,
    tied gradients and weights between the owner's and the reader's ranks."""
    _, traces = traced(tmp_path, "dp_tied", model="revgpt", tie_embeddings=True, pipe=2, dp=2,
                       stages_per_rank=2, k=2, train_batches=3, dropout=0.1,
                       optimizer={"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}})
    replay_nccl(traces)
    assert {"tied_grad", "tied_weight", "act", "grad"} <= channels(traces)
    reductions = {tuple(e["group"]) for events in traces.values() for e in events
                  if e["op"] == "collective" and e["kind"] == "all_reduce"}
    assert reductions and all(len(g) == 2 for g in reductions)  # inside a data-parallel group, never across stages


@pytest.mark.slow
def test_four_ranks_one_stage_each(tmp_path):
    _, traces = traced(tmp_path, "four", pipe=4, stages_per_rank=1, k=2, train_batches=4, dropout=0.1,
                       petra={"gradient_quality_every": 2}, eval_batches=1)
    replay_nccl(traces)

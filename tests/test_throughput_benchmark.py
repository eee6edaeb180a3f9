"""``python -m benchmarks.peers`` (throughput): the DeepSpeed baselines compute the same function as PETRA's layers, and
(slow) one tiny end-to-end run gives every variant the same partition and writes the report the timeline
model validates against. Speed itself is measured by the benchmark, never asserted here."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.lib import throughput as bench


TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--vocab-size", "32",
        "--micro-batch-size", "2"]


@pytest.mark.parametrize("model", ["revgpt", "revnet"])
def test_packed_layers_compute_what_the_plain_layers_compute(model):
    """The stacked-streams wrapper given to DeepSpeed's pipeline changes transport, not the function:
    same loss and same parameter gradients as the plain layers with the same weights."""
    args = bench.parse_args(["--model", model, "--width", "4", "--image-size", "8", *TINY])
    plain_specs, loss_fn, _ = bench.layers_and_loss(args)
    packed_specs, _, blocks = bench.layers_and_loss(args, packed=True)
    assert blocks == "PackedBlock"
    torch.manual_seed(0)
    plain = torch.nn.ModuleList([s.build() for s in plain_specs]).double()
    packed = torch.nn.ModuleList([s.build() for s in packed_specs]).double()
    for p_layer, q_layer in zip(plain, packed):
        q_layer.layer.load_state_dict(p_layer.state_dict())
    x, labels = bench.micro_batches(args, torch.device("cpu"), count=1)[0]
    if x.is_floating_point():
        x = x.double()
    losses = []
    for layers in (plain, packed):
        h = x
        for layer in layers:
            h = layer(h)
        loss = loss_fn(h, labels)
        loss.backward()
        losses.append(loss)
    assert torch.allclose(losses[0], losses[1], rtol=1e-12, atol=0)
    for p, q in zip(plain.parameters(), packed.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14)
    pair_blocks = sum(isinstance(layer, bench.PackedBlock) for layer in packed)
    assert pair_blocks == (2 if model == "revgpt" else 8)


@pytest.mark.slow
def test_every_variant_runs_on_the_same_partition_and_the_report_validates(tmp_path):
    """DeepSpeed's, PETRA's and two torch variants under the deepspeed launcher (2 CPU processes), a
    report with samples/s, peak allocated and held bytes, ratios, the fastest peers and the per-stage costs that
    petra_ds.perf.time_model.validate reads. The torch variant with two chunks per rank is checkpointed ZBV, or
    the interleaved zero-bubble schedule where this torch cannot run ZBV over gloo (``torch_pipe.unsupported``)."""
    from petra_ds.perf.time_model import validate

    out = tmp_path / "report.json"
    two = "torch_zbv_ckpt" if bench.torch_pipe.unsupported("torch_zbv_ckpt", 2, "gloo") is None \
        else "torch_interleaved_zb_ckpt"
    names = ["single", "naive_mp", "1f1b", "1f1b_ckpt", "petra", "torch_1f1b", two]
    bench.main(["--model", "revgpt", "--stages", "2", "--calls", "1", "--warmup", "1", *TINY, "--output", str(out),
                "--variants", *names])
    report = json.loads(out.read_text())
    variants = report["variants"]
    assert set(variants) == set(names)
    assert all(v["samples_per_s"] > 0 for v in variants.values())
    assert all(len(v["peak_held_bytes"]) == (1 if name == "single" else 2) for name, v in variants.items())
    for name, v in variants.items():  # the allocator's peak holds the parameters and what autograd saved
        assert len(v["peak_allocated"]) == len(v["peak_held_bytes"]), name
        for rank, held in zip(v["peak_allocated"], v["peak_held_bytes"]):
            assert sum(rank["parts"].values()) == rank["peak"] and rank["parts"]["other"] >= 0, (name, rank)
            assert rank["peak"] >= rank["parts"]["parameters"] + held > 0, (name, rank, held)
    one_per_rank = {name: tuple(v["parts"]) for name, v in variants.items() if name not in ("single", two)}
    assert len(set(one_per_rank.values())) == 1, one_per_rank
    assert len(variants[two]["parts"]) == 5  # 2 chunks per rank
    fastest = report["petra_vs_fastest_peer"]
    assert fastest["checkpointed"]["peer"] in ("1f1b_ckpt", two)
    peers = [n for n in names if n not in ("single", "petra")]
    assert fastest["overall"]["peer"] == max(peers, key=lambda n: variants[n]["median_samples_per_s"])
    assert fastest["overall"]["median_ratio"] == pytest.approx(
        variants["petra"]["median_samples_per_s"] / variants[fastest["overall"]["peer"]]["median_samples_per_s"])
    assert report["ratios"]["petra/single"] == pytest.approx(
        variants["petra"]["samples_per_s"] / variants["single"]["samples_per_s"])
    assert len(report["costs"]["stages"]) == 2 and report["costs"]["message_s"] > 0
    checked = validate(report)
    assert set(checked["variants"]) == set(names)
    rates = {v: r["predicted_samples_per_s"] for v, r in checked["variants"].items()}
    assert report["predicted_ratios"] == pytest.approx({f"petra/{v}": rates["petra"] / rates[v]
                                                        for v in names if v != "petra"})
    for name, v in variants.items():  # each rank's host work in one call, counted
        assert len(v["host_counts"]) == len(v["peak_held_bytes"]), name
        assert all(rank["bytecodes"] > 0 and rank["ops"] > 0 for rank in v["host_counts"]), name
    assert set(report["host_count_ratios"]) == {f"petra/{v}" for v in names if v not in ("single", "petra")}


def test_the_report_sets_the_timeline_models_ratios_beside_the_measured_ones():
    """From the run's stage costs, PETRA's predicted samples/s over each peer's is its time per micro-batch over
    PETRA's under the timeline model (an oracle independent of the report's measured rates); nothing without
    costs or PETRA, and a peer the model does not time is left out."""
    from petra_ds.perf.costs import Costs, StageCosts
    from petra_ds.perf.predict import seconds_per_micro_batch

    costs = Costs((StageCosts(0.010, 0.012, 0.020, 0.004), StageCosts(0.011, 0.013, 0.025, 0.003)), 0.002)
    measured = {"petra": 50.0, "1f1b": 40.0, "torch_zbv": 60.0, "zero_bubble": 70.0}
    report = {"costs": costs.to_dict(), "micro_batch_size": 8, "micro_batches": 4, "stages": 2,
              "variants": {v: {"samples_per_s": rate} for v, rate in measured.items()}}
    ratios = bench.predicted_ratios(report)
    petra = seconds_per_micro_batch("petra", costs, 4)
    assert ratios == pytest.approx({f"petra/{v}": seconds_per_micro_batch(v, costs, 4) / petra
                                    for v in ("1f1b", "torch_zbv")})
    report["variants"]["petra"]["samples_per_s"] = 5.0  # a measured rate does not move a predicted ratio
    assert bench.predicted_ratios(report) == pytest.approx(ratios)
    assert bench.predicted_ratios({**report, "variants": {"1f1b": {"samples_per_s": 1.0}}}) == {}
    del report["costs"]
    assert bench.predicted_ratios(report) == {}


def test_host_counts_compare_the_busiest_ranks():
    """PETRA's busiest rank over each peer's busiest, in bytecodes and in ops, each count on its own (the busiest
    in one need not be the busiest in the other); the one-process variant and a variant without counts are no
    peers, and without PETRA's counts there is nothing."""
    variants = {"petra": {"host_counts": [{"bytecodes": 100, "ops": 10}, {"bytecodes": 80, "ops": 30}]},
                "1f1b": {"host_counts": [{"bytecodes": 200, "ops": 20}, {"bytecodes": 50, "ops": 40}]},
                "single": {"host_counts": [{"bytecodes": 1, "ops": 1}]}, "torch_zbv": {}}
    assert bench.host_count_ratios(variants) == {"petra/1f1b": {"bytecodes": 0.5, "ops": 0.75}}
    assert bench.host_count_ratios({"1f1b": variants["1f1b"]}) == {}


def _torch_peer_step(spec: dict) -> dict:
    """One optimizer step (SGD, lr 1) of a torch pipelining peer on this rank: its chunks' weights before
    and after, and the micro-batch losses where the last chunk runs."""
    import petra_ds

    petra_ds.init_distributed(dist_backend="gloo")
    args = bench.parse_args(["--model", "revgpt", *TINY, "--layers", "4"])
    specs, loss_fn, blocks = bench.layers_and_loss(args, packed=True)
    peer = bench.torch_pipe.build(spec["variant"], specs, loss_fn, args.micro_batches, torch.device("cpu"),
                                  costs=None, method=bench.partition(args, blocks), block_pattern=blocks, seed=0)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in peer.modules]
    x, labels = (torch.cat(t) for t in zip(*bench.micro_batches(args, torch.device("cpu"), count=args.micro_batches)))
    losses = peer.step(torch.optim.SGD(peer.parameters(), lr=1.0), x, labels)
    return {"parts": peer.parts, "chunks": peer.chunks, "before": before,
            "after": [m.state_dict() for m in peer.modules], "losses": [float(loss) for loss in losses]}


@pytest.mark.parametrize("variant", ["torch_1f1b", "torch_interleaved_zb", "torch_zbv", "torch_dualpipev", "torch_zbv_ckpt",
                                     pytest.param("torch_interleaved_1f1b", marks=pytest.mark.slow),
                                     pytest.param("torch_1f1b_ckpt", marks=pytest.mark.slow)])
def test_torch_pipelining_peers_train_the_model_plain_backprop_trains(variant):
    """Each torch schedule, as the benchmark builds it on 2 processes, takes the step plain backprop of
    the whole model takes from the same weights (mean of the micro-batch losses): the chunks' placement,
    partition, loss and weight-gradient split (zero bubble) are right, so the peer's speed is that of a
    correct run."""
    from harness import launch

    reason = bench.torch_pipe.unsupported(variant, 2, "gloo")
    if reason is not None:
        pytest.skip(reason)
    results = launch({"variant": variant}, 2, target=_torch_peer_step)
    parts = results[0]["parts"]
    assert all(r["parts"] == parts for r in results)
    chunks = {c: (r["before"][i], r["after"][i]) for r in results for i, c in enumerate(r["chunks"])}
    assert sorted(chunks) == list(range(len(parts) - 1))
    args = bench.parse_args(["--model", "revgpt", *TINY, "--layers", "4"])
    specs, loss_fn, _ = bench.layers_and_loss(args, packed=True)
    oracle = torch.nn.ModuleList()
    for c in sorted(chunks):
        layers = torch.nn.Sequential(*[s.build(log=False) for s in specs[parts[c]:parts[c + 1]]])
        layers.load_state_dict({k.replace("layers.", "", 1): v for k, v in chunks[c][0].items()})
        oracle.append(layers)
    data = bench.micro_batches(args, torch.device("cpu"), count=args.micro_batches)
    losses = []
    for x, labels in data:
        for chunk in oracle:
            x = chunk(x)
        loss = loss_fn(x, labels)
        (loss / len(data)).backward()
        losses.append(loss.item())
    torch.optim.SGD(oracle.parameters(), lr=1.0).step()
    (last,) = [r["losses"] for r in results if r["losses"]]
    assert last == pytest.approx(losses, rel=1e-5)
    for c, chunk in zip(sorted(chunks), oracle):
        after = {k.replace("layers.", "", 1): v for k, v in chunks[c][1].items()}
        for name, value in chunk.state_dict().items():
            assert torch.allclose(after[name], value, rtol=1e-4, atol=1e-6), (c, name)
        assert any(not torch.equal(after[k], chunks[c][0]["layers." + k]) for k in after)  # the step moved it

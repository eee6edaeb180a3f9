"""benchmarks/throughput.py: the DeepSpeed baselines compute the same function as PETRA's layers, and
(slow) one tiny end-to-end run gives every variant the same partition and writes the report the timeline
model validates against. Speed itself is measured by the benchmark, never asserted here."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark():
    spec = importlib.util.spec_from_file_location("throughput_benchmark", os.path.join(ROOT, "benchmarks", "throughput.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--vocab-size", "32",
        "--micro-batch-size", "2"]


@pytest.mark.parametrize("model", ["revgpt", "revnet"])
def test_packed_layers_compute_what_the_plain_layers_compute(model):
    """The stacked-streams wrapper given to DeepSpeed's pipeline changes transport, not the function:
    same loss and same parameter gradients as the plain layers with the same weights."""
    bench = load_benchmark()
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
    """All five variants under the deepspeed launcher (2 CPU processes), a report with samples/s,
    ratios and the per-stage costs that petra_ds.analysis.timeline.validate reads."""
    from petra_ds.analysis.timeline import validate

    bench = load_benchmark()
    out = tmp_path / "report.json"
    bench.main(["--model", "revgpt", "--stages", "2", "--calls", "1", "--warmup", "1", *TINY, "--output", str(out)])
    report = json.loads(out.read_text())
    variants = report["variants"]
    assert set(variants) == set(bench.VARIANTS)
    assert all(v["samples_per_s"] > 0 for v in variants.values())
    parts = {name: tuple(v["parts"]) for name, v in variants.items() if name != "single"}
    assert len(set(parts.values())) == 1, parts
    assert report["ratios"]["petra/single"] == pytest.approx(
        variants["petra"]["samples_per_s"] / variants["single"]["samples_per_s"])
    assert len(report["costs"]["stages"]) == 2 and report["costs"]["message_s"] > 0
    checked = validate(report)
    assert set(checked["variants"]) == set(bench.VARIANTS)

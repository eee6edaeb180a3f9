"""How long training waits for a checkpoint, synchronous save against ``"petra": {"async_save": true}``.

One process hosts a J = 4 pipeline of linear layers with about ``--megabytes`` MB of float32 parameters (AdamW: the
checkpoint is about three times that). Per round and mode: the time ``save_checkpoint`` blocks the training loop,
and the next ``train_batch`` against a median ``train_batch`` without a save (what the background write costs the
training it overlaps). Medians over rounds (the first save of a run also maps its host memory: slower); the
ratios are synchronous over asynchronous: ``stall_ratio`` of the time ``save_checkpoint`` blocks, ``wait_ratio`` of
that plus what the next ``train_batch`` takes beyond a plain one.

    python -m benchmarks.soak checkpoint [--megabytes 50] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time

import torch

from . import throughput
from .example_runs import one_cpu_process, save_report


def stall(spec: dict) -> dict:
    """The medians of one mode (``spec["async_save"]``)."""
    from deepspeed.runtime.pipe.module import LayerSpec

    import petra_ds

    width = spec["width"]
    layers = [LayerSpec(torch.nn.Linear, width, width) for _ in range(spec["layers"])]
    model = petra_ds.PetraPipelineModule(layers, num_stages=1, stages_per_rank=4, partition_method="uniform",
                                         loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 6, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "petra": {"stages_per_rank": 4, "async_save": spec["async_save"]}}
    engine, *_ = petra_ds.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, width, generator=generator), torch.randn(8, width, generator=generator))
               for _ in range(6)]
    data = itertools.cycle(batches)
    for _ in range(2):  # the pipeline fills, the optimizer state exists
        engine.train_batch(data)
    plain, saves, after = [], [], []
    with tempfile.TemporaryDirectory() as out:
        for r in range(spec["rounds"]):
            began = time.perf_counter()
            engine.train_batch(data)
            plain.append(time.perf_counter() - began)
            began = time.perf_counter()
            engine.save_checkpoint(out, tag=f"round{r}")
            saves.append(time.perf_counter() - began)
            began = time.perf_counter()
            engine.train_batch(data)
            after.append(time.perf_counter() - began)
            engine.wait_for_checkpoint()  # outside the timings: the next round starts with no write pending
        size = sum(os.path.getsize(os.path.join(out, "round0", f)) for f in os.listdir(os.path.join(out, "round0")))
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"async_save": spec["async_save"], "parameter_bytes": parameters, "checkpoint_bytes": size,
            "save_call_s": statistics.median(saves), "train_batch_after_save_s": statistics.median(after),
            "train_batch_s": statistics.median(plain), "rounds": {"save": saves, "after": after, "plain": plain}}


def main(argv: list[str] | None = None) -> dict:
    from petra_ds.tools.spawn import launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=50.0, help="float32 parameters, in MB (10^6 bytes)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default=os.path.join("runs", "benchmarks", "checkpoint_stall_cpu.json"))
    args = parser.parse_args(argv)
    layers = 8
    width = int((args.megabytes * 1e6 / 4 / layers) ** 0.5)
    modes = {}
    for async_save in (False, True):  # one fresh process each, one after the other
        (modes["async" if async_save else "sync"],) = launch(
            {"width": width, "layers": layers, "rounds": args.rounds, "async_save": async_save}, 1,
            timeout=1800, target=stall_in_one_process)
    sync, background = modes["sync"], modes["async"]
    report = {"machine": throughput.device_name(),
              "torch": torch.__version__, "layers": layers, "width": width, **modes,
              "stall_ratio": sync["save_call_s"] / background["save_call_s"],
              "wait_ratio": (sync["save_call_s"] + sync["train_batch_after_save_s"] - sync["train_batch_s"])
              / (background["save_call_s"] + background["train_batch_after_save_s"] - background["train_batch_s"])}
    print(json.dumps({k: v for k, v in report.items() if k not in ("sync", "async")}, indent=1))
    for name, mode in modes.items():
        print(f"{name}: save_checkpoint blocks {mode['save_call_s'] * 1e3:.0f} ms, the next train_batch takes "
              f"{mode['train_batch_after_save_s'] * 1e3:.0f} ms against {mode['train_batch_s'] * 1e3:.0f} ms "
              f"({mode['checkpoint_bytes'] / 1e6:.0f} MB written)")
    print(f"saved {save_report(args.output, report)}")
    return report


def stall_in_one_process(spec: dict) -> dict:
    """:func:`stall` in a one-rank CPU world with one thread."""
    one_cpu_process()
    return stall(spec)

"""Soak: a 2-process J = 4 RevGPT trained for thousands of clocks with periodic checkpoints, watching what
each rank holds. After the warm-up, the bytes the engine holds beyond its model and optimizer (its
``Holdings``: micro-batches, inputs, messages; ``engine.holdings``) and the process's resident memory must
stop growing, and the messages each stage holds between two clocks must stay within the schedule's bound
(PETRA: one activation from the stage before, one gradient from the stage after, and the gradient a
stage keeps for its next backward: 3).

    OMP_NUM_THREADS=1 python -m benchmarks.soak --calls 500 --save-every 50   # 2,000 clocks at k = 4

Prints the summary and saves JSON and a PNG of the curves (default ``runs/benchmarks/soak_cpu.*``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import tempfile
import time

import torch

from petra_ds.util.files import save_figure

from .example_runs import save_report

#: the messages a PETRA stage may hold between two clocks: the activation and the gradient it received
#: for the next clock, and the gradient it keeps for its next backward
MESSAGE_BOUND = 3


def rss_bytes() -> int:
    """This process's resident set size now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def soak(spec: dict) -> dict:
    """One rank: train ``calls`` train_batch calls, saving every ``save_every``; per call, this rank's held
    bytes, the most messages any of its stages held, and its RSS."""
    import petra_ds

    from petra_ds.diagnostics.held import HeldTracker
    from petra_ds.models.transformer import RevGPTConfig, lm_loss, revgpt_layers
    from petra_ds.runtime.observe import Observer
    from petra_ds.tools.run_checkpoints import save
    from petra_ds.tools.runs import run_layout

    petra_ds.init_distributed()
    config = RevGPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, dropout=0.1)
    layers = revgpt_layers(config)
    layout = run_layout(len(layers), stages=4)
    model = petra_ds.PetraPipelineModule(layers, topology=layout.topology(), loss_fn=lm_loss,
                                         stages_per_rank=layout.stages_per_rank, partition_method="uniform")
    ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0,
                 "petra": {"stages_per_rank": layout.stages_per_rank, "delay_compensation": "weight_prediction"}}
    engine, *_ = petra_ds.initialize(model=model, config=ds_config)

    class MostMessages(Observer):
        """The most messages one of this rank's stages held at the end of a clock, since the last read."""

        def __init__(self) -> None:
            self.most = 0

        def clock_end(self, engine, clock: int) -> None:
            for j in engine.stages:
                held = sum(m is not None for m in engine.holdings(j).messages)
                self.most = max(self.most, held)

    watch = engine.observe(MostMessages())
    counter = HeldTracker()  # distinct storages, as the memory benchmark counts them; records no graph here
    generator = torch.Generator().manual_seed(engine.grid.data_parallel_id)
    batches = [(torch.randint(0, 64, (4, 16), generator=generator),) * 2 for _ in range(32)]
    stream = itertools.cycle(batches)
    rows, began = [], time.perf_counter()
    for call in range(1, spec["calls"] + 1):
        engine.train_batch(stream)
        if spec["save_every"] and call % spec["save_every"] == 0:
            save(engine, spec["out"], {"call": call}, keep_last=2)
        held = sum(sum(counter.measure(engine.holdings(j).categories()).values()) for j in engine.stages)
        rows.append({"call": call, "clock": engine.clock, "held_bytes": held, "most_messages": watch.most,
                     "rss_bytes": rss_bytes(), "elapsed_s": time.perf_counter() - began})
        watch.most = 0
    return {"rank": engine.global_rank, "stages": list(engine.stages), "rows": rows}


def verdict(ranks: list[dict], warmup: int) -> dict:
    """Growth after the warm-up, per rank: held bytes (the most in the run's last quarter against the
    most just after the warm-up) and RSS (the same), and the most messages any stage held."""
    out = {}
    for rank in ranks:
        rows = rank["rows"]
        after = rows[warmup:]
        quarter = max(1, len(after) // 4)
        early, late = after[:quarter], after[-quarter:]
        out[rank["rank"]] = {
            "clocks": rows[-1]["clock"],
            "held_bytes_early_max": max(r["held_bytes"] for r in early),
            "held_bytes_late_max": max(r["held_bytes"] for r in late),
            "rss_early_max": max(r["rss_bytes"] for r in early),
            "rss_late_max": max(r["rss_bytes"] for r in late),
            "most_messages": max(r["most_messages"] for r in after),
        }
    return out


def plot(ranks: list[dict], warmup: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for rank in ranks:
        clocks = [r["clock"] for r in rank["rows"]]
        top.plot(clocks, [r["rss_bytes"] / 2**20 for r in rank["rows"]], label=f"rank {rank['rank']}")
        bottom.plot(clocks, [r["held_bytes"] / 2**10 for r in rank["rows"]], label=f"rank {rank['rank']}")
    for ax in (top, bottom):
        ax.axvline(ranks[0]["rows"][warmup]["clock"], color="grey", linestyle=":", label="end of warm-up")
        ax.legend()
    top.set_ylabel("resident memory (MiB)")
    bottom.set_ylabel("engine holdings (KiB)")
    bottom.set_xlabel("clock")
    fig.suptitle("Soak: J = 4 RevGPT on 2 processes, checkpoints every 50 steps")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    from petra_ds.tools.spawn import launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500, help="train_batch calls (k = 4 clocks each)")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=100, help="calls before memory must stop growing")
    parser.add_argument("--output", default=os.path.join("runs", "benchmarks", "soak_cpu.json"),
                        help="JSON report, relative to the repository root (the PNG beside it)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        ranks = launch({"calls": args.calls, "save_every": args.save_every, "out": out}, 2, timeout=3600,
                       target=soak)
    result = {"calls": args.calls, "save_every": args.save_every, "warmup": args.warmup,
              "message_bound": MESSAGE_BOUND, "verdict": verdict(ranks, args.warmup), "ranks": ranks}
    print(json.dumps(result["verdict"], indent=1))
    path = save_report(args.output, result)
    plot(ranks, args.warmup, os.path.splitext(path)[0] + ".png")
    print(f"saved {path} and its .png")


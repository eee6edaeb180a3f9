"""What a finer partition grain buys: RevGPT's best cut from whole blocks against one from attention and MLP halves.

    OMP_NUM_THREADS=1 python -m benchmarks.peers grain --stages 2 4 8 --rounds 3

Each round measures every layer's costs at the half grain (``petra_ds.tools.run_partition.measure_specs``, the
measurement of ``--partition profile``) on one micro-batch of the throughput benchmark's RevGPT, in this process.
The block grain's costs are the sums of each block's two halves: the same measurement cut two ways, so timing noise
between two measurements does not enter the comparison (what the extra layer boundary costs at run time is the
throughput benchmark's to measure, ``python -m benchmarks.peers --grain half``). For each J and grain, PETRA's best
cut (``balanced_parts``) gives a slowest stage, which sets PETRA's clock, and an imbalance (slowest stage over the
mean stage, minus 1; 0: even). Reported per J: the medians over rounds of both grains' slowest stage and imbalance,
and the clock ratio half / block (below 1: the finer grain is faster). Saves JSON (``--output``) and prints the
table.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

from .example_runs import save_report


def measure(args: argparse.Namespace, grain: str) -> list:
    """Every layer's costs of the RevGPT at ``grain``, on one fixed micro-batch."""
    from petra_ds.models.transformer import RevGPTConfig, lm_loss, revgpt_layers
    from petra_ds.tools.run_partition import measure_specs

    torch.manual_seed(args.seed)
    config = RevGPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                          n_heads=args.heads, dropout=0.0, grain=grain)
    ids = torch.randint(args.vocab_size, (args.micro_batch_size, args.seq_len + 1),
                        generator=torch.Generator().manual_seed(args.seed))
    return measure_specs(revgpt_layers(config), (ids[:, :-1], ids[:, 1:]), lm_loss, torch.device("cpu"))


def whole_blocks(halves: list) -> list:
    """The block grain's costs from the half grain's: embedding, each block as the sum of its two halves, the rest."""
    from petra_ds.pipeline.partition import LayerCost

    def add(a: LayerCost, b: LayerCost) -> LayerCost:
        return LayerCost(a.forward + b.forward, a.forward_grad + b.forward_grad, a.backward + b.backward,
                         None if a.reconstruct is None or b.reconstruct is None else a.reconstruct + b.reconstruct)

    blocks = [add(halves[i], halves[i + 1]) for i in range(1, len(halves) - 2, 2)]
    return [halves[0], *blocks, *halves[-2:]]


def cut(costs: list, num_stages: int) -> dict:
    """PETRA's best cut of ``costs`` into ``num_stages`` stages: boundaries, each stage's seconds, imbalance."""
    from petra_ds.pipeline.partition import balanced_parts, imbalance, stage_costs

    parts = balanced_parts(costs, num_stages)
    stages = stage_costs(costs, parts)
    return {"parts": parts, "stage_s": stages, "slowest_s": max(stages), "imbalance": imbalance(costs, parts)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8], help="PETRA depths J")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8, help="reversible blocks")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="runs/benchmarks/partition_grain.json")
    args = p.parse_args(argv)
    if max(args.stages) > args.layers + 3:
        p.error(f"--stages {max(args.stages)}: the block grain has only {args.layers + 3} layers to cut")
    torch.set_num_threads(args.threads)
    rounds = []
    for r in range(args.rounds):
        halves = measure(args, "half")
        costs = {"block": whole_blocks(halves), "half": halves}
        rounds.append({"costs": {g: [dataclasses.asdict(c) for c in cs] for g, cs in costs.items()},
                       "cuts": {J: {g: cut(cs, J) for g, cs in costs.items()} for J in args.stages}})
        print(f"round {r + 1}/{args.rounds} measured", flush=True)
    table = []
    for J in args.stages:
        row = {"J": J}
        for g in ("block", "half"):
            row[f"{g}_slowest_s"] = statistics.median(rd["cuts"][J][g]["slowest_s"] for rd in rounds)
            row[f"{g}_imbalance"] = statistics.median(rd["cuts"][J][g]["imbalance"] for rd in rounds)
            row[f"{g}_parts"] = rounds[-1]["cuts"][J][g]["parts"]
        row["clock_half_over_block"] = statistics.median(
            rd["cuts"][J]["half"]["slowest_s"] / rd["cuts"][J]["block"]["slowest_s"] for rd in rounds)
        table.append(row)
    report = {"command": "python -m benchmarks.peers grain " + " ".join(argv), "torch": torch.__version__,
              "model": {k: getattr(args, k) for k in ("layers", "d_model", "heads", "seq_len", "vocab_size",
                                                       "micro_batch_size")},
              "threads": args.threads, "table": table, "rounds": rounds}
    save_report(args.output, report)
    print(f"\nRevGPT {args.layers} blocks, d {args.d_model}, seq {args.seq_len}, micro-batch {args.micro_batch_size}; "
          f"medians of {args.rounds} rounds")
    print("| J | block: slowest stage (s), imbalance | half: slowest stage (s), imbalance | clock half / block |")
    print("| --- | --- | --- | --- |")
    for row in table:
        print(f"| {row['J']} | {row['block_slowest_s']:.4f}, {100 * row['block_imbalance']:.1f}% | "
              f"{row['half_slowest_s']:.4f}, {100 * row['half_imbalance']:.1f}% | {row['clock_half_over_block']:.3f} |")


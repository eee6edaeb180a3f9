"""RevNet18 on 10 GPUs and RevGPT on 8, one stage per GPU: PETRA, DeepSpeed's 1F1B and torch's DualPipeV,
predicted by the timeline model (``petra_ds.perf``) from what one GPU measured and what the host costs.

    python -m benchmarks.gpu predict     # from the first H100 run (benchmarks/results/gpu_h100_first_run_inputs.json)
    python -m benchmarks.gpu predict --inputs benchmarks/results/gpu_<device>.json   # from python -m benchmarks.gpu

Where each input comes from (the JSON repeats it per model):

- **device seconds per stage** (measured, then assumed): plain backprop's device time per micro-batch on the
  one GPU, cut into stages. RevNet18 by the per-stage shape the timeline measured on CPU
  (``benchmarks/results/timeline_revnet.json``), RevGPT by blocks (the LM head counted by its FLOPs against a
  block's: 0.8 of one at d 768, sequence 512, vocabulary 8192), forward : forward with graph : backward = 1 : 1 : 2.
  Assumed: the CPU's shape holds on a GPU.
- **host seconds per stage and micro-batch** (measured, then assumed): PETRA's host seconds per micro-batch on
  the one GPU, all stages together, per op it dispatched; times the ops each stage dispatches (counted on CPU at
  the model's depth, heads, stages and k by ``python -m benchmarks.host_overhead``; counts do not depend on width,
  sequence or batch). A peer's host time: PETRA's over the ratio of the two on negligible layers in one process
  (the host-overhead benchmark's time part, for the code that ran), spread over the stages as plain backprop's ops.
  Assumed: a rank's host costs what its share of the one process did, and with no host synchronisation inside
  a ``train_batch`` each stage's micro-batch takes max(device, host).
- **this commit's PETRA** on a run of older code, two ways: host time as the ops counted now (each op costing
  what it did), and host time as the CPU measured it (PETRA's host over plain's, now against then).
- **messages** (assumed): the stage-boundary activation at 100 GB/s between neighbouring GPUs.

Writes ``benchmarks/results/predict_gpus_<inputs>.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any

from . import host_overhead
from .example_runs import ROOT, one_cpu_process, save_report

RESULTS = os.path.join(ROOT, "benchmarks", "results")
TARGETS = {"revnet18": 10, "revgpt": 8}
VARIANTS = ("petra", "1f1b", "torch_dualpipev")
#: which of host_overhead's time variants measures each peer's host time (and plain backprop's)
ENGINES = {"1f1b": "deepspeed_1f1b_one_stage", "torch_dualpipev": "torch_1f1b_one_stage", "plain": "plain"}
LINK_BYTES_PER_S = 100e9
#: the paper's Tab. 5: RevNet18 on 10 GPUs, ms per micro-batch of 256
PAPER_REVNET18_MS_PER_256 = 53.4


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", default=os.path.join(RESULTS, "gpu_h100_first_run_inputs.json"))
    parser.add_argument("--host-overhead", default=os.path.join(RESULTS, "host_overhead_cpu.json"),
                        help="the host-overhead benchmark's report of this commit: PETRA's host time against the "
                             "peers'")
    parser.add_argument("--output", default=None)
    return parser.parse_args(argv)


def measured(row: dict, k: int) -> dict[str, Any]:
    """Plain backprop's device seconds and PETRA's host seconds per micro-batch on the one GPU, and how known."""
    if "petra_profiled_host_seconds_per_call" in row:
        return {"plain_device_s": 0.75 * row["petra_kernel_seconds_per_call"] / k,
                "petra_host_s": row["petra_profiled_host_seconds_per_call"] / k,
                "how": "PETRA's kernel time x 3/4 (assumed: PETRA's arithmetic is 4/3 plain's) as plain's device "
                       "time; the profiler's host time as PETRA's (pessimistic: profiling slows the host)"}
    if row.get("plain_device_seconds_per_call") and "petra_host_seconds_per_call" in row:  # CUDA kernels seen
        return {"plain_device_s": row["plain_device_seconds_per_call"] / k,
                "petra_host_s": row["petra_host_seconds_per_call"] / k,
                "how": "profiled kernel and host times of this run"}
    petra = row["petra_seconds_per_call"]
    plain = row.get("plain_seconds_per_call", petra / row.get("petra/plain", 1.0))
    return {"plain_device_s": plain / k, "petra_host_s": petra / k,
            "how": "plain's time per call as its device time (assumed: plain is device-bound) and PETRA's as its "
                   "host time (assumed: host-bound, an upper bound otherwise)"}


@functools.lru_cache(maxsize=None)
def ops_per_stage(name: str, J: int, dtype: str) -> dict[str, Any]:
    """PETRA's and plain's ops per micro-batch per stage at J stages (this commit's code), counted on CPU."""
    args = host_overhead.parse_args([])
    row = host_overhead.count_ops(name, args, dtype, stages=J)
    return {"petra": [s["petra_ops"] for s in row["stages"]], "plain": [s["plain_ops"] for s in row["stages"]],
            "petra_total": row["petra_ops"], "parts": row["parts"], "layers": row["layers"]}


def device_costs(name: str, plain_device_s: float, ops: dict, J: int, sizes: dict):
    """Per-stage device costs summing to plain's device seconds per micro-batch (see the docstring)."""
    from petra_ds.perf.costs import Costs, StageCosts

    if name == "revnet18":
        with open(os.path.join(RESULTS, "timeline_revnet.json")) as f:
            shape = Costs.from_dict(json.load(f)["models"]["revnet18"]["costs"])
        if shape.stage_count != J:
            raise ValueError(f"the RevNet18 shape has {shape.stage_count} stages, not {J}")
        scale = plain_device_s / sum(s.forward_grad + s.backward for s in shape.stages)
        stages = [StageCosts(scale * s.forward, scale * s.forward_grad, scale * s.backward) for s in shape.stages]
        message = sizes["revnet_batch"] * sizes["revnet_width"] * sizes["image_size"] ** 2 * 4
    else:
        parts, layers = ops["parts"], ops["layers"]
        blocks = [sum(t == "RevGPTBlock" for t in layers[a:b]) for a, b in zip(parts, parts[1:])]
        d, seq = sizes["d_model"], sizes["seq_len"]
        blocks[-1] += 2 * d * sizes["vocab_size"] / (24 * d * d + 4 * seq * d)  # the LM head, in blocks' FLOPs
        per_block = plain_device_s / sum(blocks)
        stages = [StageCosts(n * per_block / 3, n * per_block / 3, 2 * n * per_block / 3) for n in blocks]
        message = sizes["revgpt_batch"] * sizes["seq_len"] * sizes["d_model"] * 2 * 4  # two fp32 streams
    return Costs(tuple(stages), message / LINK_BYTES_PER_S)


def host_ratios(report: dict) -> dict[str, float]:
    """PETRA's host time per ``train_batch`` over each peer's and plain backprop's on negligible layers, one process
    (``host_overhead.py``'s time part)."""
    seconds = report["time"]["seconds_per_call"]
    return {v: seconds["petra"] / seconds[t] for v, t in ENGINES.items()}


def predict_model(name: str, row: dict, sizes: dict, ran: dict, now: dict) -> dict:
    """``ran``/``now``: the op totals (``(model, dtype) -> ops``, None: counted here) and host ratios of the code
    that ran on the GPU and of this commit."""
    from petra_ds.perf.predict import predict_host_bound

    J, dtype = TARGETS[name], row["dtype"]
    got = measured(row, sizes["k"])
    prefix = "revnet" if name == "revnet18" else "revgpt"
    now_total = ops_per_stage(name, sizes[f"{prefix}_stages"], dtype)["petra_total"]  # at the run's J
    ran_total = now_total if ran["ops"] is None else ran["ops"][(name, row["dtype"])]
    per_op = got["petra_host_s"] / ran_total
    ops = ops_per_stage(name, J, dtype)
    costs = device_costs(name, got["plain_device_s"], ops, J, sizes)
    # PETRA: the host seconds of each op, times the ops of each stage (the shape of this commit's, assumed the
    # same for the code that ran); a peer: PETRA's host time over the measured ratio, spread as plain's ops
    petra_as_run = [per_op * n * ran_total / now_total for n in ops["petra"]]
    peers = {v: [got["petra_host_s"] / ran["ratios"][v] * n / sum(ops["plain"]) for n in ops["plain"]]
             for v in VARIANTS[1:]}
    scenarios = {"device_only": {v: 0.0 for v in VARIANTS}, "host_as_run": {"petra": petra_as_run, **peers}}
    if ran["ops"] is not None:  # this commit's PETRA, the peers as they ran: host time as ops, or as CPU host time
        scenarios["now_host_as_ops"] = {"petra": [per_op * n for n in ops["petra"]], **peers}
        cpu = now["ratios"]["plain"] / ran["ratios"]["plain"]
        scenarios["now_host_as_cpu_time"] = {"petra": [cpu * h for h in petra_as_run], **peers}
    ks = sorted({sizes["k"], 2 * J})
    table = {s: {str(k): {v: 1e3 * t for v, t in predict_host_bound(costs, k, host).items()} for k in ks}
             for s, host in scenarios.items()}
    return {"model": name, "stages": J, "micro_batch": sizes[f"{prefix}_batch"], "dtype": row["dtype"], "inputs": got,
            "host_seconds_per_op": per_op, "petra_ops_per_micro_batch_at_run": ran_total,
            "ops_per_stage": {"petra": ops["petra"], "plain": ops["plain"]},
            "host_ratios": {"ran": ran["ratios"], "now": now["ratios"]}, "costs": costs.to_dict(),
            "ms_per_micro_batch": table,
            "host_ms_per_stage": {s: {v: [1e3 * h for h in hs] for v, hs in host.items()}
                                  for s, host in scenarios.items() if s != "device_only"}}


def print_model(result: dict) -> None:
    name = result["model"]
    print(f"\n{name}: J = {result['stages']} GPUs, micro-batch {result['micro_batch']}, {result['dtype']}; "
          f"host {1e6 * result['host_seconds_per_op']:.1f} us per op ({result['inputs']['how']})")
    for scenario, by_k in result["ms_per_micro_batch"].items():
        for k, row in by_k.items():
            cells = ", ".join(f"{v} {t:.2f} ms" for v, t in row.items())
            peers = [t for v, t in row.items() if v != "petra"]
            speed = f"; PETRA {min(peers) / row['petra']:.2f}x the fastest peer" if peers else ""
            print(f"  {scenario:20s} k={k:>3s}: {cells}{speed}")
    if name == "revnet18":
        ms = result["ms_per_micro_batch"]
        per_256 = {s: by_k[min(by_k, key=int)]["petra"] * 256 / result["micro_batch"] for s, by_k in ms.items()}
        print("  PETRA ms per 256 samples: " + ", ".join(f"{s} {t:.1f}" for s, t in per_256.items())
              + f" (the paper's Tab. 5: {PAPER_REVNET18_MS_PER_256})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    one_cpu_process()
    with open(args.inputs) as f:
        inputs = json.load(f)
    if inputs.get("tiny"):
        raise SystemExit(f"{args.inputs} is a --tiny run of python -m benchmarks.gpu: predict from a run at its "
                         "default sizes (the op counts here are those of its 12-block RevGPT and RevNet18)")
    with open(args.host_overhead) as f:
        now = {"ops": None, "ratios": host_ratios(json.load(f))}
    ran = now
    if inputs.get("commit", "").startswith("f6c0446"):  # the code that ran was counted and timed on that commit
        with open(os.path.join(RESULTS, "host_overhead_before_cpu.json")) as f:
            before = json.load(f)
        ran = {"ops": {(r["model"], r["dtype"]): r["petra_ops"] for r in before["ops"] if r["check_finite"]},
               "ratios": host_ratios(before)}
    report = {"command": "python -m benchmarks.gpu predict " + " ".join(argv),
              "inputs": os.path.relpath(args.inputs, ROOT), "device": inputs["device"],
              "link_bytes_per_s": LINK_BYTES_PER_S, "models": {}}
    for row in inputs["time"]:
        if row["model"] not in TARGETS:
            continue
        result = predict_model(row["model"], row, inputs["sizes"], ran, now)
        report["models"][f"{row['model']}_{row['dtype']}"] = result
        print_model(result)
    stem = os.path.splitext(os.path.basename(args.inputs))[0].removesuffix("_inputs")
    print(f"saved {save_report(args.output or os.path.join(RESULTS, f'predict_gpus_{stem}.json'), report)}")
    return 0


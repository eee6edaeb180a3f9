"""Time to quality: the wall time PETRA and the fastest pipeline peer need to reach the validation loss
that backprop reaches at step N, on the same processes, model, text and optimizer.

    OMP_NUM_THREADS=1 python -m benchmarks.accuracy time-to-loss --peer 1f1b --steps 320

The peer is a backprop pipeline (DeepSpeed's ``1f1b``, ``1f1b_ckpt``, ``naive_mp`` or one of torch's ``torch_*``
schedules, as in the throughput benchmark, ``python -m benchmarks.peers``); its gradients are backprop's, so the
target is the peer's own validation loss at step N. PETRA (``--compensation``, default its best: weight prediction)
then trains until its validation loss reaches that target, at most ``--max-steps``; with ``--petra-micro-batches K
[K ...]``, once per K, the same global batch split into K micro-batches (what a smaller micro-batch costs in speed
against what it buys in loss). Both use AdamW with DeepSpeed's warm-up + cosine schedule over ``--max-steps``, so
the peer's step N is not the end of its schedule and PETRA has the same learning rates to catch up with. A RevGPT
with the LM example's defaults (8 blocks, d = 256, seq 128, dropout 0.1, BPE 4096, micro-batch 4, k = 4, lr 3e-4)
on this Python's standard-library docstrings (``lm_accuracy.stdlib_corpus``).

Wall time counts the training calls only: every ``--eval-every`` steps the ranks meet, the slowest rank's
training seconds so far are recorded, and the validation loss (the same ``--eval-batches`` held-out
micro-batches for both, dropout off) is measured off the clock. The time to the target is interpolated
linearly between the two evaluations around it. Writes ``runs/benchmarks/time_to_loss_<device>.json``
and a PNG of both curves against wall time (``--output`` to choose). A run takes tens of minutes on a CPU:
rank 0 of each race shows a progress bar on stderr and a line per evaluation (step, validation loss,
training and elapsed seconds).

Under a memory cap: after its race each run measures every rank's peak memory over one more step, off the clock, as
the allocator sees it (``throughput.peak_allocated``), and each PETRA race says whether the peer's largest rank
fits under its own (``peer_fits``). Race the fastest peer configuration that fits PETRA's peak (the table of
``python -m benchmarks.memory capped``) to answer "which trains to this loss fastest in PETRA's memory?"; the peer
may take a smaller micro-batch than PETRA at the same global batch (``--micro-batch-size 2 --micro-batches 8
--petra-micro-batches 4``: the peer at 2 x 8, PETRA at 4 x 4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from petra_ds.runtime.config import MUON_LR_RATIO
from petra_ds.util.files import save_figure, write_text_atomic

from . import throughput
from .example_runs import save_report
from .lm_accuracy import stdlib_corpus

ROOT = throughput.ROOT
PEERS = throughput.PEERS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", choices=PEERS, required=True,
                   help="the backprop pipeline to race (the fastest in the throughput benchmark's report)")
    p.add_argument("--compensation", default="weight_prediction",
                   help="PETRA's delay_compensation: a method name or a JSON list / object")
    p.add_argument("--petra-optimizer", default="adamw", choices=("adamw", "muon"),
                   help="PETRA's optimizer (the peer trains with AdamW)")
    p.add_argument("--steps", type=int, default=320, help="N: the target is the peer's validation loss here")
    p.add_argument("--max-steps", type=int, default=480, help="the LR schedule's length and PETRA's limit")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=32, help="held-out micro-batches (a multiple of k)")
    p.add_argument("--stages", type=int, default=2, help="processes, one pipeline rank each")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--micro-batches", type=int, default=4, help="k")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--petra-micro-batches", type=int, nargs="+", default=None, metavar="K",
                   help="PETRA splits the same global batch into K micro-batches (a smaller micro-batch: its stage 0 "
                        "is 2(J-1)/K steps behind instead of 2(J-1)/k), one race per K; the peer keeps --micro-batches")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--corpus-chars", type=int, default=3_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON report, relative to the repository root (default "
                   "runs/benchmarks/time_to_loss_<device>.json); the PNG goes beside it")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--target", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--split", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.eval_batches % args.micro_batches:
        p.error(f"--eval-batches {args.eval_batches} must be a multiple of --micro-batches {args.micro_batches}")
    for split in args.petra_micro_batches or ():
        if split < 1 or (args.micro_batch_size * args.micro_batches) % split:
            p.error(f"--petra-micro-batches {split} must divide the global batch of "
                    f"{args.micro_batch_size * args.micro_batches} sequences")
    if not args.steps <= args.max_steps or args.steps % args.eval_every:
        p.error("--steps must be a multiple of --eval-every and at most --max-steps")
    return args


def model_args(args: argparse.Namespace, vocab: int) -> argparse.Namespace:
    """The throughput benchmark's arguments for the same RevGPT, so both benchmarks build it one way."""
    return throughput.parse_args([
        "--model", "revgpt", "--stages", str(args.stages), "--micro-batches", str(args.micro_batches),
        "--micro-batch-size", str(args.micro_batch_size), "--layers", str(args.layers),
        "--d-model", str(args.d_model), "--heads", str(args.heads), "--seq-len", str(args.seq_len),
        "--vocab-size", str(vocab), "--dropout", str(args.dropout), "--seed", str(args.seed)])


def optimizer_config(args: argparse.Namespace, method: str = "") -> dict:
    """AdamW for both, or DeepSpeed's Muon (its hidden matrices at ``MUON_LR_RATIO`` times the lr) for PETRA
    with --petra-optimizer muon."""
    optimizer = {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                             "torch_adam": True}}
    if method == "petra" and args.petra_optimizer == "muon":
        optimizer = {"type": "muon", "params": {"lr": args.lr, "muon_lr": MUON_LR_RATIO * args.lr, "momentum": 0.95,
                                                "betas": [0.9, 0.95], "weight_decay": 0.01, "torch_adam": True}}
    return {"optimizer": optimizer,
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": args.max_steps,
                                                               "warmup_num_steps": args.warmup_steps}}}


# --- one method, inside the launched processes ---

def data(args: argparse.Namespace):
    """(tokenizer vocabulary size, endless training micro-batches, the held-out micro-batches)."""
    from petra_ds.data.text import build_tokenizer, lm_loader, lm_stream, load_text, pack

    tokenizer = build_tokenizer(os.path.join(args.data_dir, "tokenizer"))
    raw = load_text([os.path.join(args.data_dir, name) for name in ("train.txt", "valid.txt")], seed=args.seed)
    train = iter(lm_stream(pack(raw["train"], tokenizer, args.seq_len), args.micro_batch_size, seed=args.seed))
    val = list(lm_loader(pack(raw["validation"], tokenizer, args.seq_len), args.micro_batch_size, train=False))
    if len(val) < args.eval_batches:
        raise ValueError(f"{len(val)} held-out micro-batches, fewer than --eval-batches {args.eval_batches}")
    return len(tokenizer), train, val[: args.eval_batches]


def engine_method(args: argparse.Namespace, margs: argparse.Namespace, train, val):
    """(train one step, validation loss, every rank's peak memory over one more step) of PETRA or a DeepSpeed
    pipeline."""
    import deepspeed

    import petra_ds

    config = {**throughput.ds_config(margs, args.worker), **optimizer_config(args, args.worker)}
    module = throughput.pipeline_module(margs, args.worker)
    if args.worker == "petra":
        value = args.compensation
        config["petra"]["delay_compensation"] = json.loads(value) if value.lstrip()[:1] in "{[" else value
        engine, *_ = petra_ds.initialize(model=module, config=config, model_parameters=module.parameters())
    else:
        engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    step = lambda: engine.train_batch(train)  # noqa: E731
    return (step, lambda: float(engine.eval_batch(iter(val), num_micro_batches=len(val))),
            lambda: throughput.peak_allocated(step, list(module.parameters()), engine.optimizer, engine.device))


def torch_method(args: argparse.Namespace, margs: argparse.Namespace, train, val):
    """(train one step, validation loss, every rank's peak memory over one more step) of a torch pipelining
    schedule, with the same optimizer and LR schedule DeepSpeed builds from the config."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR
    from torch import distributed as dist

    peer = throughput.torch_peer(margs, args.worker, torch.device("cpu"))
    params = optimizer_config(args)
    adamw = params["optimizer"]["params"]
    optimizer = torch.optim.AdamW(peer.parameters(), lr=adamw["lr"], betas=tuple(adamw["betas"]),
                                  weight_decay=adamw["weight_decay"])
    scheduler = WarmupCosineLR(optimizer, **params["scheduler"]["params"])
    k = args.micro_batches

    def batch(micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.cat(t) for t in zip(*micro_batches))

    def step() -> None:
        peer.step(optimizer, *batch([next(train) for _ in range(k)]))
        scheduler.step()

    def evaluate() -> float:
        # torch's own forward-only schedule (``schedule.eval``) fails on the V-shaped schedules (a chunk
        # waits for a backward that eval never runs), so rank 0 evaluates every chunk's weights in order
        states = {i: {k: v.detach().clone() for k, v in m.state_dict().items()} for i, m in zip(peer.chunks, peer.modules)}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, states)
        mean = [0.0]
        if dist.get_rank() == 0:
            mean = [whole_model_loss(margs, peer.parts, {i: s for g in gathered for i, s in g.items()}, val)]
        dist.broadcast_object_list(mean, src=0)
        return float(mean[0])

    return step, evaluate, lambda: throughput.peak_allocated(step, list(peer.parameters()), optimizer,
                                                             torch.device("cpu"))


def whole_model_loss(margs: argparse.Namespace, parts: list[int], states: dict, val) -> float:
    """Mean loss over ``val`` of the chunks ``parts`` cut, with weights ``states`` (by chunk), dropout off."""
    specs, loss_fn, blocks = throughput.layers_and_loss(margs, packed=True)
    chunks = []
    for i in range(len(parts) - 1):
        chunk = throughput.torch_pipe.Chunk([s.build(log=False) for s in specs[parts[i]:parts[i + 1]]],
                                            [False] * (parts[i + 1] - parts[i]), checkpointed=False)
        chunk.load_state_dict(states[i])
        chunks.append(chunk.eval())
    losses = []
    with torch.no_grad():
        for x, labels in val:
            for chunk in chunks:
                x = chunk(x)
            losses.append(float(loss_fn(x, labels)))
    return sum(losses) / len(losses)


def worker(args: argparse.Namespace) -> None:
    from torch import distributed as dist

    import petra_ds
    from petra_ds.runtime.shutdown import shutdown

    torch.set_num_threads(1)
    if args.worker == "petra" and args.split:  # the same sequences per step, in more micro-batches
        size = args.micro_batch_size * args.micro_batches // args.split
        args.eval_batches = args.eval_batches * args.micro_batch_size // size
        args.micro_batch_size, args.micro_batches = size, args.split
    petra_ds.init_distributed()
    torch.manual_seed(args.seed)
    vocab, train, val = data(args)
    margs = model_args(args, vocab)
    build = torch_method if args.worker.startswith("torch_") else engine_method
    step, evaluate, peak = build(args, margs, train, val)
    steps = args.steps if args.target is None else args.max_steps
    curve, trained, began = [], 0.0, time.perf_counter()
    goal = f"to step {steps}" if args.target is None else f"to val loss {args.target:.4f}, at most {steps} steps"
    # stderr: the launcher's stdout is discarded (DeepSpeed's log lines), and tqdm writes to stderr
    rank0 = dist.get_rank() == 0
    bar = tqdm(total=steps, desc=f"{args.worker} {goal}", disable=not rank0, dynamic_ncols=True)
    for n in range(1, steps + 1):
        start = time.perf_counter()
        step()
        trained += time.perf_counter() - start
        bar.update()
        if n % args.eval_every == 0:
            slowest = torch.tensor([trained], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            curve.append({"step": n, "train_s": float(slowest), "val_loss": evaluate()})
            bar.set_postfix(val_loss=f"{curve[-1]['val_loss']:.4f}")
            if rank0:
                bar.write(f"{args.worker}: step {n}, val loss {curve[-1]['val_loss']:.4f}, training "
                          f"{curve[-1]['train_s']:.0f} s, elapsed {time.perf_counter() - began:.0f} s",
                          file=sys.stderr)
            if args.target is not None and curve[-1]["val_loss"] <= args.target:
                break
    bar.close()
    peaks = peak()  # off the clock, after the race: one more step under the allocator's counter
    if rank0:
        write_text_atomic(args.result, json.dumps({"curve": curve, "peak_allocated": peaks}))
    del step, evaluate, peak  # they hold the engine, and the engine its process groups
    shutdown()


# --- the driver ---

def prepare(args: argparse.Namespace, data_dir: str) -> int:
    """The corpus and one tokenizer trained on it, for every worker to load; returns the vocabulary size."""
    from petra_ds.data.text import build_tokenizer, load_text

    files = stdlib_corpus(data_dir, args.corpus_chars)
    raw = load_text(files, seed=args.seed)
    tokenizer = build_tokenizer("bpe", raw["train"], args.vocab_size)
    tokenizer.save_pretrained(os.path.join(data_dir, "tokenizer"))
    return len(tokenizer)


def petra_name(args: argparse.Namespace, split: int | None) -> str:
    """A PETRA race's name in the report: its compensation, and its micro-batches per step when split."""
    if split is None:
        return f"petra ({args.compensation})"
    return f"petra ({args.compensation}, k = {split}, micro-batch {args.micro_batch_size * args.micro_batches // split})"


def launch(args: argparse.Namespace, method: str, argv: list[str], data_dir: str, target: float | None,
           split: int | None = None) -> dict:
    result = os.path.join(data_dir, f"{method}{split or ''}.json")
    extra = ([] if target is None else ["--target", repr(target)]) + ([] if split is None else ["--split", str(split)])
    throughput.run_launched(__spec__.name, args.stages, [*argv, "--worker", method, "--data-dir", data_dir,
                                                         "--result", result, *extra],
                            dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1"))  # Muon's kernel eager
    with open(result) as f:
        return json.load(f)


def time_to(curve: list[dict], target: float) -> float | None:
    """Training seconds at which ``curve`` first reaches ``target`` (linear between evaluations), or None."""
    previous = {"train_s": 0.0, "val_loss": float("inf")}
    for point in curve:
        if point["val_loss"] <= target:
            if previous["val_loss"] == float("inf"):
                return point["train_s"]
            share = (previous["val_loss"] - target) / (previous["val_loss"] - point["val_loss"])
            return previous["train_s"] + share * (point["train_s"] - previous["train_s"])
        previous = point
    return None


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, run in report["runs"].items():
        ax.plot([p["train_s"] for p in run["curve"]], [p["val_loss"] for p in run["curve"]], marker=".",
                label=f"{name}: {run['seconds_to_target']:.0f} s" if run["seconds_to_target"] else f"{name}: not reached")
    ax.axhline(report["target_val_loss"], color="gray", linestyle="--",
               label=f"backprop's loss at step {report['args']['steps']}")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"RevGPT, {report['args']['stages']} processes: time to backprop's step-{report['args']['steps']} loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return None
    began = time.time()
    with tempfile.TemporaryDirectory() as data_dir:
        print(f"corpus ({args.corpus_chars} characters of docstrings) and BPE tokenizer", flush=True)
        prepare(args, data_dir)
        splits = args.petra_micro_batches or [None]
        races = 1 + len(splits)
        print(f"1/{races} {args.peer}: {args.steps} steps for the target, on {args.stages} processes "
              f"(DeepSpeed's start-up, then a line every {args.eval_every} steps)", flush=True)
        runs = {args.peer: launch(args, args.peer, argv, data_dir, target=None)}
        target = next(p["val_loss"] for p in runs[args.peer]["curve"] if p["step"] == args.steps)
        for n, split in enumerate(splits, start=2):
            print(f"{n - 1}/{races} done in {time.time() - began:.0f} s; {n}/{races} {petra_name(args, split)} "
                  f"until val loss {target:.4f}, at most {args.max_steps} steps", flush=True)
            runs[petra_name(args, split)] = launch(args, "petra", argv, data_dir, target, split)
    print(f"{races}/{races} done; {time.time() - began:.0f} s in all", flush=True)
    for name, run in runs.items():  # the peer first
        run["peak"] = max(r["peak"] for r in run["peak_allocated"])
        run["seconds_to_target"] = time_to(run["curve"], target)
        reached = [p["step"] for p in run["curve"] if p["val_loss"] <= target]
        run["steps_to_target"] = reached[0] if reached else None
        mine, peer = run["seconds_to_target"], runs[args.peer]["seconds_to_target"]
        run["time_over_peer"] = None if mine is None else mine / peer
        if name != args.peer:  # the peer's largest rank under this race's: the race is under PETRA's cap
            run["peer_fits"] = runs[args.peer]["peak"] <= run["peak"]
    report = {"command": "python -m benchmarks.accuracy time-to-loss " + " ".join(argv),
              "device": throughput.device_name(),
              "torch": torch.__version__, "args": vars(args), "target_val_loss": target, "runs": runs,
              "petra_time_over_peer": runs[petra_name(args, splits[0])]["time_over_peer"]}
    tag = "gpu" if torch.cuda.is_available() else "cpu"
    output = args.output or os.path.join("runs", "benchmarks", f"time_to_loss_{tag}.json")
    path = save_report(output, report)
    plot(report, os.path.splitext(path)[0] + ".png")
    print(f"target (peer's val loss at step {args.steps}): {target:.4f}")
    for name, run in runs.items():
        ratio = run["time_over_peer"]
        print(f"{name:44s} steps to target {run['steps_to_target']}, seconds {run['seconds_to_target']}, "
              "time / peer's: " + ("not reached" if ratio is None else f"{ratio:.3f}x")
              + f", peak {run['peak'] / 2**20:.1f} MiB (largest rank)"
              + ("" if name == args.peer else f", the peer {'fits' if run['peer_fits'] else 'does not fit'} under it"))
    print(f"saved {output}")
    return report


if __name__ == "__main__":  # the processes launch starts (python -m benchmarks.lib.time_to_loss --worker ...)
    main()

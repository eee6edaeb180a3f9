"""Train a RevNet (or a ResNet baseline) with PETRA or with DeepSpeed's 1F1B pipeline.

    deepspeed --num_gpus 2 examples/revnet/train.py --deepspeed_config ds_configs/petra.json --dataset digits
    deepspeed --num_gpus 2 examples/revnet/train.py --deepspeed_config ds_configs/backprop.json --dataset digits
    torchrun --nproc_per_node 2 examples/revnet/train.py --deepspeed_config ds_configs/petra.json ...
    python examples/revnet/train.py --deepspeed_config ds_configs/petra.json ...   # one process, all stages

A config with a "petra" section trains with PETRA (petra_ds.initialize); one without trains with
DeepSpeed's synchronous 1F1B schedule. Without an "optimizer" section the paper's recipe is used
(petra_ds.tools.recipe).

The layout fits the processes launched (petra_ds.tools.runs.choose_layout; rank 0 prints it): without --stages
and --data-parallel, the fewest data-parallel replicas that leave at most one pipeline rank per layer, and
as many PETRA stages per rank as the layers allow: one stage per residual block (10 for RevNet18, 18 for
RevNet34/50) when the pipeline ranks divide that count, otherwise a few stages of two blocks (RevNet18 on
18 processes: 9 ranks x 2 replicas, J = 9). --stages picks J, --data-parallel the replicas.

The datasets: cifar10 reads <data-dir>/cifar-10-batches-py/ (--download fetches it when online), digits
is scikit-learn's bundled set (offline), imagenet32 / imagenet read the folders under --data-dir.

--save-every N checkpoints to <output-dir>/checkpoints every N train_batch calls; --resume continues from
the latest one: step count, optimizer and LR schedule, the data stream's position, metrics.jsonl (an error
when there is none; --resume auto starts fresh then).

--partition profile cuts the layers where the stages' measured costs balance (petra_ds.tools.run_partition): rank
0 times every layer on one training micro-batch and writes <output-dir>/layer_costs.json, which every rank
cuts from (--layer-costs FILE reuses an earlier one); the 1F1B baseline is cut from the same costs, balanced
for its own schedule. summary.json records the partition: method, layer boundaries, costs file.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.runtime.utils import set_random_seed
from torch import nn
from tqdm import tqdm

import petra_ds
from petra_ds.data import INFO, build_dataset, make_loader
from petra_ds.data.stream import resumable_loader
from petra_ds.models.revnet import resnet_layers, revnet_layers
from petra_ds.tools.recipe import no_decay_groups, paper_recipe, scheduler_factory, sgd_factory
from petra_ds.tools.run_partition import agreed_partition, baseline_module, shared_layer_costs
from petra_ds.tools.run_checkpoints import finish as finish_checkpoints, resume, save
from petra_ds.tools.runs import (Layout, RunFiles, add_run_arguments, against_baseline, apply_global_batch,
                                 apply_run_arguments, run_layout, run_main, skipped_steps)

ARCHS = {f"{kind}{depth}": (kind, depth) for kind in ("revnet", "resnet") for depth in (18, 34, 50)}


class ClassificationLoss(nn.Module):
    """Cross-entropy that also counts correct predictions when called without gradients (eval)."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.correct, self.total = 0, 0

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            self.correct += int((logits.argmax(dim=1) == labels).sum())
            self.total += labels.numel()
        return nn.functional.cross_entropy(logits.float(), labels)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="revnet18", choices=sorted(ARCHS))
    parser.add_argument("--dataset", default="cifar10", choices=sorted(INFO))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--download", action="store_true", help="download CIFAR-10 when online")
    parser.add_argument("--epochs", type=int, default=None, help="default: 300 on CIFAR-10/digits, 90 on ImageNet")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many train_batch calls")
    parser.add_argument("--output-dir", default="runs/revnet")
    parser.add_argument("--seed", type=int, default=0)
    add_run_arguments(parser)
    parser.add_argument("--width", type=int, default=64, help="base width (64 is the paper's network)")
    parser.add_argument("--stages", type=int, default=None,
                        help="PETRA stages J (default: fitted to the processes, one per block when they divide it)")
    parser.add_argument("--data-parallel", type=int, default=None,
                        help="pipeline replicas (default: the fewest that fit the processes to the blocks)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per process")
    parser.add_argument("--warmup-epochs", type=float, default=5.0)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def build_layers(args, info) -> list:
    kind, depth = ARCHS[args.arch]
    return (revnet_layers if kind == "revnet" else resnet_layers)(depth, info.num_classes, info.cifar_stem, args.width)


def partition_method(args, config: dict, layers: list, layout: Layout) -> str:
    """How the layers are cut: "profile" when asked; otherwise "parameters" for DeepSpeed's 1F1B, and PETRA
    partitions the blocks into J stages: one per block when J equals their count, "parameters" balance for
    an explicit smaller --stages, and "uniform" (contiguous, one or two blocks a stage) for a J fitted to
    the processes, where balancing parameters would pile the many small high-resolution blocks onto stage
    0 (RevNet34 at J = 9: 8 of 18 blocks). Both leave no stage empty."""
    if args.partition == "profile":
        return "profile"
    if "petra" not in config or args.stages is not None and layout.stages != len(layers):
        return "parameters"
    return "uniform"


def build_model(args, config: dict, layers: list, layout: Layout, loss_fn: nn.Module, method: str, costs=None):
    """The pipeline module cut by ``method`` (``costs``: the layer costs of "profile")."""
    topology = layout.topology()
    if "petra" not in config:
        # seed_fn: DeepSpeed's "parameters" partition yields numpy indices that random.seed rejects
        return baseline_module(layers, topology=topology, loss_fn=loss_fn, partition_method=method,
                               layer_costs=costs, seed_layers=True, seed_fn=lambda seed: set_random_seed(int(seed)),
                               base_seed=args.seed, dynamic_shape=True)
    config["petra"]["stages_per_rank"] = layout.stages_per_rank
    input_buffer = petra_ds.PetraConfig.from_dict(config["petra"]).input_buffer  # a stage's cost depends on it
    return petra_ds.PetraPipelineModule(layers, topology=topology, loss_fn=loss_fn,
                                        stages_per_rank=layout.stages_per_rank, partition_method=method,
                                        layer_costs=costs, input_buffer=input_buffer, base_seed=args.seed)


def load_data(args) -> tuple:
    """(train, eval) data sets; a missing local copy ends the run with how to get it, not a traceback."""
    try:
        return (build_dataset(args.dataset, args.data_dir, train=True, download=args.download),
                build_dataset(args.dataset, args.data_dir, train=False, download=args.download))
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None


def evaluate(engine, loader, loss_fn: ClassificationLoss) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole evaluation set, the same on every rank."""
    loss_fn.reset()
    loss = engine.eval_batch(iter(loader), num_micro_batches=len(loader))
    counts = torch.tensor([loss_fn.correct, loss_fn.total], dtype=torch.float64, device=engine.device)
    grid = engine.grid
    if grid.data_parallel_size > 1:
        dist.all_reduce(counts, group=grid.get_data_parallel_group())
    if grid.pipe_parallel_size > 1:
        last = grid.stage_to_global(stage_id=grid.pipe_parallel_size - 1)
        dist.broadcast(counts, src=last, group=grid.get_pipe_parallel_group())
    return float(loss), float(counts[0] / counts[1])


def main() -> None:
    args = parse_args()
    petra_ds.init_distributed()
    torch.manual_seed(args.seed)
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    method = apply_run_arguments(args, config)
    info = INFO[args.dataset]
    epochs = args.epochs or (90 if args.dataset.startswith("imagenet") else 300)
    loss_fn = ClassificationLoss()
    layers = build_layers(args, info)
    layout = run_layout(len(layers), args.stages, args.data_parallel, petra="petra" in config, name=args.arch)
    apply_global_batch(args, config, layout)
    replicas = layout.data_parallel
    train_set, eval_set = load_data(args)
    micro, k = config["train_micro_batch_size_per_gpu"], config.get("gradient_accumulation_steps", 1)
    costs, costs_file = None, None
    if args.partition == "profile":  # the first training micro-batch of the stream
        costs, costs_file = shared_layer_costs(
            layers, lambda: next(iter(resumable_loader(train_set, micro, args.seed))), loss_fn, args.output_dir,
            reuse=args.layer_costs, keep_existing=args.resume)
    cut = partition_method(args, config, layers, layout)
    model = build_model(args, config, layers, layout, loss_fn, cut, costs)
    partition = agreed_partition(model, cut, costs_file)

    part = (dist.get_rank() % replicas, replicas)  # this replica's rows of each micro-batch (data innermost)
    eval_loader = make_loader(eval_set, micro, train=False, workers=args.workers)
    steps_per_epoch = max(1, len(train_set) // (micro * replicas) // k)

    recipe = paper_recipe(args.dataset, epochs, micro * k * replicas, args.warmup_epochs)
    extra = {}
    if "optimizer" not in config:
        extra = dict(optimizer=sgd_factory(recipe),
                     model_parameters=no_decay_groups(model.named_parameters(), recipe.weight_decay),
                     lr_scheduler=scheduler_factory(recipe, steps_per_epoch))
    engine, _, _, _ = petra_ds.initialize(args=args, model=model, config=config, **extra)

    rank0 = dist.get_rank() == 0
    state = resume(engine, args.output_dir, fall_back=args.resume == "auto") if args.resume else None
    done = engine.global_steps  # train_batch calls behind us: k micro-batches each, in both engines
    files = RunFiles(args.output_dir, enabled=rank0, resumed_at=done if state else None)
    total_steps = epochs * steps_per_epoch if args.max_steps is None else min(args.max_steps, epochs * steps_per_epoch)
    data = iter(resumable_loader(train_set, micro, args.seed, start=done * k, workers=args.workers, part=part))
    metrics, losses = list(files.kept_rows), (state or {}).get("losses", [])
    best, trained_s = (state or {}).get("best", 0.0), (state or {}).get("elapsed_s", 0.0)
    start, stopped = time.time(), False
    bar = tqdm(total=total_steps, initial=done, disable=not rank0, desc=f"{method} {args.arch}", dynamic_ncols=True)
    for step in range(done + 1, total_steps + 1):
        loss = float(engine.train_batch(data))
        files.gradient_quality(engine)
        if not math.isnan(loss):
            losses.append((step, loss))
            bar.set_postfix(loss=f"{loss:.3f}")
        bar.update()
        last = step == total_steps
        if step % steps_per_epoch == 0 or last:
            if last and method == "petra":
                engine.drain()
                files.gradient_quality(engine)
            eval_loss, eval_acc = evaluate(engine, eval_loader, loss_fn)
            best = max(best, eval_acc)
            elapsed = trained_s + time.time() - start
            row = {"epoch": step / steps_per_epoch, "step": step, "train_loss": losses[-1][1] if losses else None,
                   "eval_loss": eval_loss, "eval_acc": eval_acc, "elapsed_s": elapsed,
                   "samples_per_s": step * micro * k * replicas / elapsed}
            metrics.append(row)
            files.log(row, engine, [("Eval/loss", eval_loss, step), ("Eval/accuracy", eval_acc, step)], bar.write)
        if args.save_every and step % args.save_every == 0:
            progress = {"losses": losses, "best": best, "elapsed_s": trained_s + time.time() - start}
            save(engine, args.output_dir, progress, keep_last=args.keep_last)
        if step == args.stop_after and not last:
            stopped = True
            break
    bar.close()
    finish_checkpoints(engine)
    if stopped:
        if rank0:
            print(f"stopped after step {args.stop_after} of {total_steps}; continue with --resume")
        return
    skipped = skipped_steps(engine)  # a collective under PETRA
    if rank0:
        summary = {"method": method, "arch": args.arch, "dataset": args.dataset, "final_eval_acc": metrics[-1]["eval_acc"],
                   "best_eval_acc": best, "final_eval_loss": metrics[-1]["eval_loss"],
                   "samples_per_s": metrics[-1]["samples_per_s"], "steps": total_steps, "world_size": dist.get_world_size(),
                   "stages": getattr(engine, "num_petra_stages", engine.num_stages), "layout": vars(layout),
                   "partition": partition, "settings": engine.run_settings, "args": vars(args), "config": config,
                   "recipe": vars(recipe) if extra else None, **skipped}
        if args.baseline:
            summary["against_baseline"] = against_baseline(summary, args.baseline, "final_eval_acc",
                                                           higher_is_better=True)
            print(summary["against_baseline"]["label"], flush=True)
        files.summary(summary)
        files.gradient_quality_plot(f"{method} {args.arch}: gradient quality per stage")
        files.curves(losses, metrics, eval_key="eval_loss", eval_label="eval", loss_label="loss",
                     right=("epoch", "eval_acc", "epoch", "eval accuracy (%)"), right_scale=100)
        print(json.dumps({k: summary[k] for k in ("method", "final_eval_acc", "best_eval_acc", "samples_per_s")}))


if __name__ == "__main__":
    run_main(main)

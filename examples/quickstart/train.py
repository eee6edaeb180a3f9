"""The smallest PETRA run: a 9-layer toy network mixing reversible and non-reversible layers.

    deepspeed --num_gpus 4 examples/quickstart/train.py --deepspeed_config ds_configs/quickstart.json
    torchrun --nproc_per_node 2 examples/quickstart/train.py --deepspeed_config ds_configs/quickstart.json
    python examples/quickstart/train.py --deepspeed_config ds_configs/quickstart.json   # one process, all stages

The layout fits the processes launched (petra_ds.tools.runs.choose_layout, printed by rank 0; it overrides the
config's petra.stages_per_rank): one process hosts all J = 9 stages, one per layer (the paper's
single-device setting on the same engine); 4 processes are 4 pipeline ranks of 2 stages each (J = 8, one
stage holding two layers); more than 9 processes add data-parallel replicas, each training on its own
toy data. Rank 0 prints the losses and writes a JSON summary with --output.
"""

import argparse
import itertools
import json

import deepspeed
import torch
from deepspeed import comm as dist
from torch import nn

import petra_ds
from petra_ds.tools.runs import run_layout, run_main
from petra_ds.schedule import delay
from petra_ds.tools.toy import toy_data, toy_layer_specs
from petra_ds.util.files import write_text_atomic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=30, help="train_batch() calls")
    parser.add_argument("--distinct-micro-batches", type=int, default=16)
    parser.add_argument("--output", default=None, help="summary JSON written by rank 0")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    petra_ds.init_distributed()
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    layers = toy_layer_specs(dropout=0.1)
    layout = run_layout(len(layers))
    config.setdefault("petra", {})["stages_per_rank"] = layout.stages_per_rank
    model = petra_ds.PetraPipelineModule(layers, topology=layout.topology(), loss_fn=nn.CrossEntropyLoss(),
                                         stages_per_rank=layout.stages_per_rank, partition_method="uniform")
    engine, _, _, _ = petra_ds.initialize(args=args, model=model, config=config)

    # each data-parallel replica its own micro-batches (seeded by replica; one replica up to 9 processes)
    data = toy_data(args.distinct_micro_batches, engine.train_micro_batch_size_per_gpu(),
                    seed=engine.grid.data_parallel_id, dtype=torch.float32)
    stream = itertools.cycle(data)
    if dist.get_rank() == 0:
        stages = engine.num_petra_stages  # micro-batch m runs at stage j at clock m + j, its backward tau_j later
        print(f"the loss is nan until the pipeline has filled: the first micro-batch reaches the last of the "
              f"{stages} stages at clock {stages - 1}, and every stage backpropagates from clock "
              f"{delay(0, stages)} on", flush=True)
    losses = []
    for step in range(args.steps):
        loss = engine.train_batch(stream).item()
        losses.append(loss)
        if dist.get_rank() == 0:
            print(f"step {step + 1:3d}  clock {engine.clock:4d}  loss {loss:.4f}", flush=True)
    engine.drain()
    eval_loss = engine.eval_batch(iter(data), num_micro_batches=len(data)).item()
    if dist.get_rank() == 0:
        summary = {"world_size": dist.get_world_size(), "data_parallel": layout.data_parallel,
                   "num_stages": engine.num_petra_stages,
                   "stages_per_rank": engine.stages_per_rank, "clock": engine.clock, "losses": losses,
                   "eval_loss": eval_loss, "settings": engine.run_settings}
        print(json.dumps({k: v for k, v in summary.items() if k not in ("losses", "settings")}))
        if args.output:
            write_text_atomic(args.output, json.dumps(summary, indent=1))


if __name__ == "__main__":
    run_main(main)

"""The paper's Tab. 3 memory estimate, computed from the real model.

    python -m petra_ds.perf.memory_estimate            # RevNet50, ImageNet 224x224, micro-batch 64, fp32, J = 18

Per stage j of J (one stage per residual block, as in the paper) a delayed-gradient method holds, between
a micro-batch's forward and its backward, ``tau_j = 2(J-1-j)`` micro-batches in flight: their inputs
(input buffer) and the parameters their forward used (parameter buffer). The estimate is the model's
parameters plus those buffers, without the input buffer of stage 0 (its inputs are the data set's), for
the four combinations of the paper's table; PETRA keeps no input buffer in its reversible stages and no
parameter buffer at all. Activation shapes come from running one sample through the layers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..nn.reversible import as_tuple, is_reversible
from ..schedule import delay

GB = 1e9
#: Tab. 3 of the paper: (input buffer, parameter buffer) -> (GB, saving in %)
PAPER_TAB3 = {(True, True): (44.5, 0.0), (True, False): (43.6, 2.0), (False, True): (21.2, 52.3),
              (False, False): (20.3, 54.3)}


@dataclass
class StageMemory:
    index: int
    name: str
    reversible: bool
    delay: int
    input_bytes: int  # one micro-batch's input of this stage
    param_bytes: int


def stage_memory(layers: Sequence[nn.Module], sample_shape: Sequence[int], micro_batch: int,
                 bytes_per_value: int = 4) -> list[StageMemory]:
    """One stage per layer: its input size for ``micro_batch`` samples and its parameter size."""
    J = len(layers)
    x: object = torch.zeros(1, *sample_shape)
    out = []
    with torch.no_grad():
        for j, layer in enumerate(layers):
            layer.eval()
            values = sum(t.numel() for t in as_tuple(x))
            params = sum(p.numel() for p in layer.parameters())
            out.append(StageMemory(j, type(layer).__name__, is_reversible(layer), delay(j, J),
                                   values * micro_batch * bytes_per_value, params * bytes_per_value))
            x = layer(x)
    return out


def estimate(stages: Sequence[StageMemory], input_buffer: bool, param_buffer: bool) -> dict[str, float]:
    """Bytes of the model, the input buffers and the parameter buffers for one buffer configuration.

    ``input_buffer=False`` drops the buffer of the reversible stages only (they reconstruct); the
    other stages must keep their inputs in any case."""
    model = sum(s.param_bytes for s in stages)
    inputs = sum(s.delay * s.input_bytes for s in stages[1:] if input_buffer or not s.reversible)
    params = sum(s.delay * s.param_bytes for s in stages) if param_buffer else 0
    return {"model": model, "input_buffer": inputs, "param_buffer": params, "total": model + inputs + params}


def table3(stages: Sequence[StageMemory]) -> list[dict]:
    rows = []
    base = estimate(stages, True, True)["total"]
    for (inputs, params), (paper_gb, paper_saving) in PAPER_TAB3.items():
        e = estimate(stages, inputs, params)
        rows.append({"stores_inputs": inputs, "stores_params": params, **{f"{k}_gb": v / GB for k, v in e.items()},
                     "saving_pct": 100 * (1 - e["total"] / base), "paper_gb": paper_gb,
                     "paper_saving_pct": paper_saving})
    return rows


def revnet_stages(depth: int = 50, image: int = 224, micro_batch: int = 64, num_classes: int = 1000,
                  base_width: int = 64) -> list[StageMemory]:
    from ..models.revnet import revnet_layers

    torch.manual_seed(0)
    layers = [spec.build() for spec in revnet_layers(depth, num_classes, cifar=image <= 64, base_width=base_width)]
    return stage_memory(layers, (3, image, image), micro_batch)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--micro-batch", type=int, default=64)
    args = parser.parse_args(argv)
    stages = revnet_stages(args.depth, args.image, args.micro_batch)
    print(f"RevNet{args.depth}, {args.image}x{args.image}, micro-batch {args.micro_batch}, fp32, J = {len(stages)}")
    print(f"{'stage':>5s} {'layer':16s} {'rev':>4s} {'tau':>4s} {'input MB':>9s} {'params MB':>9s}")
    for s in stages:
        print(f"{s.index:5d} {s.name:16s} {'yes' if s.reversible else 'no':>4s} {s.delay:4d} "
              f"{s.input_bytes / 1e6:9.1f} {s.param_bytes / 1e6:9.2f}")
    rows = table3(stages)
    print(f"\n{'input buf':>9s} {'param buf':>9s} {'model':>7s} {'inputs':>7s} {'params':>7s} {'total GB':>9s} "
          f"{'saving':>7s} | {'paper GB':>8s} {'saving':>7s}")
    for r in rows:
        print(f"{'yes' if r['stores_inputs'] else 'no':>9s} {'yes' if r['stores_params'] else 'no':>9s} "
              f"{r['model_gb']:7.2f} {r['input_buffer_gb']:7.2f} {r['param_buffer_gb']:7.2f} {r['total_gb']:9.1f} "
              f"{r['saving_pct']:6.1f}% | {r['paper_gb']:8.1f} "
              f"{r['paper_saving_pct']:6.1f}%")
    return rows


if __name__ == "__main__":
    main()

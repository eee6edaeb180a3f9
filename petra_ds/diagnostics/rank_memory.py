"""Per-rank peak memory with one stage per rank: PETRA, with and without ``fifo_offload``, against DeepSpeed's
1F1B, computed from bytes measured on each stage's real layers.

    python -m petra_ds.diagnostics.rank_memory --depth 18 --image 32 --micro-batch 128    # RevNet18 on 10 GPUs

Measured per stage, one micro-batch at a time, on this machine (:func:`measure_stages`): parameters, optimizer
state after a step, the stage's input and output, what a forward with autograd keeps for its backward (the
saved tensors, the input and the output: one micro-batch of a backprop schedule's stash), and the allocator's
peak above the stage's model while one forward and backward run (``workspace``, counted by
:class:`petra_ds.diagnostics.allocated.AllocatedStorages`).

Computed per rank j of J (:func:`rank_peaks`):

- both: the model, its gradients and the optimizer state (``static``), plus one micro-batch's ``workspace``;
- PETRA: the messages waiting between two clocks (the next input with its labels; the output gradient, with
  the output itself for a stage that reconstructs, ``schedule.reconstructs``), and the input FIFO of a stage
  that keeps its inputs: ``2(J-1-j)`` of them, or with ``fifo_offload`` the head between clocks and, within a
  clock, the entry just stored until its copy to the host has ended; stage 0 keeps its ``2(J-1)`` raw
  micro-batches the same way; stages that reconstruct keep nothing;
- 1F1B: rank j holds ``J - j`` micro-batches at its peak (its warm-up's forwards and the one in backward), each
  but the one in backward stashed whole (saved tensors, input, output).

The FIFO and message rule is the one the engine's own ledger counts (``engine.memory_report()``); the tests hold
the two to each other.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..nn.reversible import as_tuple, is_reversible
from ..runtime.ledger import tensor_bytes
from ..schedule import delay, reconstructs
from ..util.nested import map_tensors, tensors_in
from .allocated import AllocatedStorages
from .held import HeldTracker


@dataclass
class StageBytes:
    """One stage's bytes, measured on its real layer for one micro-batch."""
    index: int
    name: str
    reversible: bool
    params: int
    optimizer_state: int
    input: int
    output: int
    stash: int  # what a forward with autograd keeps for the backward: saved tensors, input and output
    workspace: int  # the allocator's peak above the model, gradients and optimizer state during forward+backward


def measure_stages(layers: Sequence[nn.Module], sample: torch.Tensor,
                   optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> list[StageBytes]:
    """One stage per layer: run ``sample`` (one micro-batch) through the layers in turn and measure each."""
    out = []
    x: object = sample
    for j, layer in enumerate(layers):
        params = [p for p in layer.parameters() if p.requires_grad]
        opt = optimizer(params)
        inputs = map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), x)
        _step(layer, inputs, opt)  # gradients and optimizer state exist from here on, as in training
        with AllocatedStorages() as counter:  # no hook on autograd, and nothing of the stage before freed inside
            before = counter.live_bytes
            _backward(layer(inputs))
            workspace = counter.peak_bytes - before
        tracker = HeldTracker(exclude=params)
        with tracker.recording():
            y = layer(inputs)
        stash = sum(tracker.measure({"inputs": inputs, "outputs": y}).values())
        out.append(StageBytes(j, type(layer).__name__, is_reversible(layer), tensor_bytes(params),
                              tensor_bytes([list(s.values()) for s in opt.state.values()]), tensor_bytes(inputs),
                              tensor_bytes(y), stash, workspace))
        with torch.no_grad():
            x = layer(x)
    return out


def _backward(y: object) -> None:
    outputs = [t for t in as_tuple(y) if t.requires_grad]
    torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def _step(layer: nn.Module, inputs: object, opt: torch.optim.Optimizer) -> None:
    _backward(layer(inputs))
    opt.step()
    opt.zero_grad(set_to_none=False)
    for t in tensors_in(inputs):
        t.grad = None


def rank_peaks(stages: Sequence[StageBytes], labels: int = 0,
               input_buffer: str = "non_reversible") -> list[dict[str, int]]:
    """Per rank (one stage each): the bytes of each part and the peaks of PETRA, PETRA with ``fifo_offload``
    and 1F1B (the rule is the module's docstring). ``labels``: one micro-batch's labels, which travel with the
    activations to the last stage."""
    J = len(stages)
    rows = []
    for s in stages:
        j, tau = s.index, delay(s.index, J)
        rebuilds = reconstructs(j, J, s.reversible, input_buffer)
        static = 2 * s.params + s.optimizer_state
        fifo = 0 if rebuilds else tau * s.input  # stage 0: its raw micro-batches
        head = min(fifo, s.input)
        in_copy = s.input if tau > 1 and not rebuilds else 0
        messages = ((s.input + labels if j > 0 else 0)
                    + ((2 if rebuilds else 1) * s.output if j < J - 1 else 0))
        in_flight = J - j
        rows.append({"rank": j, "static": static, "workspace": s.workspace, "fifo": fifo, "fifo_offloaded": head,
                     "messages": messages, "stash_micro_batches": in_flight,
                     "petra": static + fifo + messages + s.workspace,
                     "petra_offload": static + head + in_copy + messages + s.workspace,
                     "1f1b": static + (in_flight - 1) * s.stash + s.workspace})
    return rows


def revnet_stages(depth: int, image: int, micro_batch: int, base_width: int = 64, num_classes: int | None = None,
                  lr: float = 0.1, momentum: float = 0.9) -> list[StageBytes]:
    """RevNet-``depth``, one stage per layer, with the paper's SGD with momentum."""
    from ..models.revnet import revnet_layers

    torch.manual_seed(0)
    cifar = image <= 64
    classes = num_classes or (10 if cifar else 1000)
    layers = [spec.build() for spec in revnet_layers(depth, classes, cifar=cifar, base_width=base_width)]
    sample = torch.randn(micro_batch, 3, image, image)
    return measure_stages(layers, sample, lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum))


def summary(rows: Sequence[dict[str, int]]) -> dict[str, float]:
    """The largest rank of each schedule and PETRA's against 1F1B's."""
    largest = {name: max(r[name] for r in rows) for name in ("petra", "petra_offload", "1f1b")}
    return {**{f"largest_{k}": v for k, v in largest.items()},
            "petra_over_1f1b": largest["petra"] / largest["1f1b"],
            "petra_offload_over_1f1b": largest["petra_offload"] / largest["1f1b"]}


def revnet_report(depth: int, image: int, micro_batch: int, base_width: int = 64) -> dict:
    """The measured stages, the computed ranks and their summary for RevNet-``depth`` in fp32, one stage per layer."""
    stages = revnet_stages(depth, image, micro_batch, base_width)
    rows = rank_peaks(stages, labels=micro_batch * torch.int64.itemsize)
    return {"model": f"RevNet{depth}", "image": image, "micro_batch": micro_batch, "base_width": base_width,
            "J": len(stages), "stages": [asdict(s) for s in stages], "ranks": rows, "summary": summary(rows)}


def print_report(report: dict) -> None:
    mib = 2 ** 20
    print(f"{report['model']} {report['image']}x{report['image']}, micro-batch {report['micro_batch']}, width "
          f"{report['base_width']}, fp32, one stage per rank (J = {report['J']}), MiB")
    print(f"{'rank':>4s} {'layer':16s} {'static':>8s} {'work':>8s} {'FIFO':>8s} {'PETRA':>8s} {'offload':>8s} "
          f"{'1F1B':>8s}")
    for s, r in zip(report["stages"], report["ranks"]):
        print(f"{r['rank']:4d} {s['name']:16s} {r['static'] / mib:8.1f} {r['workspace'] / mib:8.1f} "
              f"{r['fifo'] / mib:8.1f} {r['petra'] / mib:8.1f} {r['petra_offload'] / mib:8.1f} {r['1f1b'] / mib:8.1f}")
    print(json.dumps(report["summary"], indent=1))


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=18)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=128)
    parser.add_argument("--base-width", type=int, default=64)
    args = parser.parse_args(argv)
    report = revnet_report(args.depth, args.image, args.micro_batch, args.base_width)
    print_report(report)
    return report


if __name__ == "__main__":
    main()

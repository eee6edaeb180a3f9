"""Why torch's zero-bubble schedules hold as much with activation checkpointing as without it.

    OMP_NUM_THREADS=1 python -m benchmarks.peers split-backward

A zero-bubble schedule (interleaved ZB, ZBV, DualPipeV in ``torch.distributed.pipelining``) splits each
micro-batch's backward into an input-gradient pass now (``stage_backward_input``) and a weight-gradient pass
later (``stage_backward_weight``). This benchmark runs a stack of MLP blocks, plain or under torch's non-reentrant
checkpoint, with one backward or with that split (torch's own two functions), and counts every live tensor storage
(``petra_ds.diagnostics.allocated``) above what was live before (the weights): after the forward (what a schedule
holds per micro-batch between its forward and its backward), between the two passes (what it holds per
micro-batch until the weight pass), and the peak.
Saves JSON (``--output``) and prints the table.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import checkpoint

from .example_runs import save_report

MIB = 2 ** 20


def measure(layers: nn.ModuleList, x: torch.Tensor, checkpointed: bool, split: bool) -> dict:
    """MiB live after the forward, between the input- and weight-gradient passes (``split``), and at the peak, above
    what was live before (the weights and whatever else the process holds)."""
    from petra_ds.diagnostics.allocated import AllocatedStorages

    layers.zero_grad(set_to_none=True)
    with AllocatedStorages() as counter:
        before = counter.live_bytes
        x = x.detach().requires_grad_()
        h = x
        for layer in layers:
            h = checkpoint(layer, h, use_reentrant=False) if checkpointed else layer(h)
        after_forward = counter.live_bytes - before
        dh = torch.ones_like(h)
        between = None
        if split:
            _, groups = stage_backward_input([h], [dh], [x], layers.parameters())
            between = (counter.live_bytes - before) / MIB
            stage_backward_weight(layers.parameters(), groups)
        else:
            h.backward(dh)
        del h, dh, x
    return {"checkpointed": checkpointed, "split_backward": split, "after_forward_mib": after_forward / MIB,
            "between_passes_mib": between, "peak_mib": (counter.peak_bytes - before) / MIB}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rows", type=int, default=512, help="tokens in the micro-batch")
    p.add_argument("--output", default="runs/benchmarks/ckpt_split_backward.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    d = args.width
    layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                           for _ in range(args.blocks))
    x = torch.randn(args.rows, d)
    rows = [measure(layers, x, c, s) for c in (False, True) for s in (False, True)]
    report = {"command": "python -m benchmarks.peers split-backward " + " ".join(argv),
              "torch": torch.__version__, "model": vars(args), "rows": rows}
    save_report(args.output, report)
    print("| checkpointing | backward | live after forward (MiB) | live between input and weight passes | peak |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        between = "" if r["between_passes_mib"] is None else f"{r['between_passes_mib']:.1f}"
        print(f"| {'on' if r['checkpointed'] else 'off'} | {'split' if r['split_backward'] else 'one pass'} | "
              f"{r['after_forward_mib']:.1f} | {between} | {r['peak_mib']:.1f} |")


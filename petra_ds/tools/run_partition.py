"""The cost-balanced partition of a launched run: one measurement, the same cut on every rank.

``--partition profile`` in the example scripts. Each rank timing its own copy of the layers would get
other numbers, and the exact balanced cut (``petra_ds.pipeline.partition``) can move a boundary for a few
microseconds, so rank 0 alone measures and writes the costs to one file that every rank cuts from
(:func:`shared_layer_costs`); :func:`agreed_partition` checks that the ranks did cut alike. The backprop
baseline is cut from the same costs by its own schedule's rule (:func:`baseline_module`), so a comparison
of the two methods is not a comparison of a balanced partition with an unbalanced one.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from ..pipeline.module import PetraPipelineModule, layer_module, petra_parts
from ..pipeline.partition import LayerCost, load_costs, save_costs
from ..util.nested import map_tensors

#: the costs file ``--partition profile`` writes in a run's output directory
COSTS_FILE = "layer_costs.json"


def this_device() -> torch.device:
    """The device DeepSpeed's engine will give this rank (``LOCAL_RANK``'s accelerator), made current now:
    object collectives over NCCL run on the current device, which is every rank's first GPU until the
    engine sets it."""
    device = torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def build_all(specs: Sequence[Any]) -> list[Callable]:
    """Every layer built as DeepSpeed's ``PipelineModule`` builds its local ones: a ``LayerSpec``'s module,
    one module per tie key (called through its ``forward_fn``), a module or function as given."""
    tied: dict[str, nn.Module] = {}
    layers: list[Callable] = []
    for spec in specs:
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            module = tied[spec.key]
            layers.append(module if spec.forward_fn is None else functools.partial(spec.forward_fn, module))
        elif isinstance(spec, LayerSpec):
            layers.append(spec.build())
        else:
            layers.append(spec)
    return layers


def measure_specs(specs: Sequence[Any], micro_batch: tuple[Any, Any], loss_fn: Callable,
                  device: torch.device) -> list[LayerCost]:
    """Every layer's costs on ``device`` and ``micro_batch = (inputs, labels)``, from a copy of the layers
    built here; the random streams are left as they were, so building and measuring change no later draw."""
    from ..perf.measure import measure_layer_costs

    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        layers = build_all(specs)
        for module in {id(m): m for m in map(layer_module, layers) if m is not None}.values():
            module.to(device)
        x, labels = map_tensors(lambda t: t.to(device), micro_batch)
        return measure_layer_costs(layers, x, loss_fn=loss_fn, labels=labels)


def shared_layer_costs(specs: Sequence[Any], micro_batch: Callable[[], tuple[Any, Any]], loss_fn: Callable,
                       output_dir: str, *, reuse: str | None = None,
                       keep_existing: bool = False) -> tuple[list[LayerCost], str]:
    """The layers' costs, read by every rank from one file, and that file's path.

    With ``reuse`` (an earlier run's costs file) every rank reads it. Otherwise rank 0 measures the layers
    (:func:`measure_specs` on the accelerator DeepSpeed will give it, on ``micro_batch()``, called on rank
    0 only) and writes them atomically to ``<output_dir>/layer_costs.json``; ``keep_existing`` (a resumed
    run) keeps a file already there, so the stages match the checkpoint's. Every rank waits for rank 0's
    outcome (a failure there ends every rank, none waits for a file that will not come), then reads the
    file: the output directory must be visible to every rank. All ranks call this.
    """
    device = this_device()
    if reuse is not None:
        path = reuse
    else:
        path = os.path.join(output_dir, COSTS_FILE)
        failure: Exception | None = None
        if dist.get_rank() == 0 and not (keep_existing and os.path.exists(path)):
            try:
                os.makedirs(output_dir, exist_ok=True)
                save_costs(measure_specs(specs, micro_batch(), loss_fn, device), path)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the measured copy of the whole model is gone: give its memory back
            except Exception as error:  # told to the other ranks below, then raised here
                failure = error
        outcome = [None if failure is None else repr(failure)]
        dist.broadcast_object_list(outcome, src=0)  # the barrier: rank 0 has written the file, or failed
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise RuntimeError(f"rank 0 could not measure the layer costs: {outcome[0]}")
    if not os.path.isfile(path):
        where = "" if reuse is not None else (": rank 0 wrote it, so the output directory is not shared with "
                                              "this rank; give every node a copy and pass it with --layer-costs")
        raise FileNotFoundError(f"rank {dist.get_rank()} finds no layer costs file {path}{where}")
    return load_costs(path), path


def agreed_partition(module: PipelineModule, method: str, costs_file: str | None = None) -> dict:
    """``{"method", "parts", "layer_costs"}`` of this run (for its summary), once every rank has been
    checked to hold the same layer boundaries: a rank that cut otherwise would exchange activations
    of the wrong shapes with its neighbours, or wait forever for them. All ranks call this."""
    this_device()
    parts = [int(p) for p in petra_parts(module)]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, parts)
    if any(p != every[0] for p in every):
        cuts = "; ".join(f"rank {r}: {p}" for r, p in enumerate(every))
        raise RuntimeError(f"the ranks cut the layers into different stages ({cuts}); every rank must cut from "
                           "the same partition method and the same layer costs file")
    return {"method": method, "parts": parts, "layer_costs": costs_file}


def baseline_module(layers: Sequence[Any], *, partition_method: str, layer_costs: Any = None,
                    partition_rule: str = "backprop", **kwargs: Any) -> PipelineModule:
    """The module of DeepSpeed's own pipeline schedule (1F1B). ``"profile"``, which DeepSpeed does not
    know, builds a ``PetraPipelineModule`` at one stage per rank, balanced for ``partition_rule``
    (``"backprop_ckpt"`` with activation checkpointing): DeepSpeed's engine runs it like any
    ``PipelineModule``."""
    if partition_method == "profile":
        return PetraPipelineModule(layers, partition_method="profile", layer_costs=layer_costs, stages_per_rank=1,
                                   partition_rule=partition_rule, **kwargs)
    return PipelineModule(layers, partition_method=partition_method, **kwargs)

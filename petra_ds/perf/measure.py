"""Timing a stage's primitives and a message between ranks with torch, to fill :class:`StageCosts` from
the real model, in this process or on each rank of a benchmark run."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ..util.nested import map_tensors, tensors_in
from .costs import Costs, StageCosts

__all__ = ["measure_layer_costs", "measure_message_seconds", "measure_stage_costs", "revnet_costs"]


def _tensors(x: Any) -> list[torch.Tensor]:
    return list(tensors_in(x))


def _leaves(x: Any, grad: bool) -> Any:
    return map_tensors(lambda t: t.detach().requires_grad_(grad and t.is_floating_point()), x)


def _sync(tensors: Sequence[torch.Tensor]) -> None:
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def _modules(stage: Any, depth: int = 0) -> list[nn.Module]:
    """The modules behind a stage callable, whose buffers the measurement must restore: a module, a
    list of layers, ``functools.partial(forward_fn, module)``, or a bound method (``petra_ds`` stage's
    ``run``) of an object holding modules or lists of them."""
    if isinstance(stage, nn.Module):
        return [stage]
    if isinstance(stage, (list, tuple)):
        return [m for layer in stage for m in _modules(layer, depth)]
    found = [a for a in getattr(stage, "args", ()) if isinstance(a, nn.Module)]
    owner = getattr(stage, "__self__", None)
    if owner is not None and depth == 0:
        found += _modules(owner, 1) if isinstance(owner, nn.Module) else [
            m for value in vars(owner).values() if isinstance(value, (nn.Module, list, tuple))
            for m in _modules(value, 1)]
    return found


def measure_stage_costs(stage: Callable | Sequence[Callable], x: Any, params: Iterable[torch.Tensor] | None = None, *,
                        loss_fn: Callable | None = None, labels: Any = None,
                        optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
                        input_grad: bool = True, split_backward: bool = True, repeats: int = 5,
                        warmup: int = 1) -> dict[str, float]:
    """Median seconds of one stage's ``forward``, ``forward_grad``, ``backward`` and ``step``.

    ``stage`` is a callable or a list of layers applied in order; ``x`` one micro-batch of its input. With
    ``loss_fn`` (the last stage) the forward with a graph includes ``loss_fn(out, labels)`` and the
    backward starts from the loss; otherwise it starts from a random output gradient. ``input_grad``:
    whether the backward also produces the gradient of ``x`` (False for stage 0, whose input is data).
    ``step`` times ``optimizer`` (a factory of a parameter list; default AdamW) on copies of ``params``
    (default: the stage's parameters). With ``split_backward`` and an output of several tensors, also
    ``backward_split``: DeepSpeed's pipeline backward, one call per output tensor (see :class:`StageCosts`).
    The caller's state is left as it was: parameter gradients, buffers (batch-norm statistics) and the
    RNG are restored, and the optimizer never touches the model.
    """
    layers = list(stage) if isinstance(stage, (list, tuple)) else [stage]

    def run(inp: Any) -> Any:
        for layer in layers:
            inp = layer(inp)
        return inp

    modules = _modules(layers)
    if params is None:
        params = [p for m in modules for p in m.parameters()]
    params = list({id(p): p for p in params if p.requires_grad}.values())
    saved_grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    buffers = {id(b): b for m in modules for b in m.buffers()}.values()
    saved_buffers = [(b, b.detach().clone()) for b in buffers]
    tensors = _tensors(x)
    devices = [t.device.index or 0 for t in tensors if t.is_cuda]
    timings: dict[str, list[float]] = defaultdict(list)

    def timed(name: str, fn: Callable[..., Any], record: bool, *args: Any) -> Any:
        _sync(tensors)
        t0 = time.perf_counter()
        out = fn(*args)
        _sync(tensors)
        if record:
            timings[name].append(time.perf_counter() - t0)
        return out

    def one_by_one(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        for i, (out, grad) in enumerate(zip(outs, grads)):
            out.backward(grad, retain_graph=i < len(outs) - 1)

    def graph() -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        with torch.enable_grad():
            out = run(_leaves(x, input_grad))
            if loss_fn is not None:
                return [loss_fn(out, labels)], None
        outs = [t for t in _tensors(out) if t.requires_grad]
        return outs, [torch.randn_like(t) for t in outs]

    try:
        with torch.random.fork_rng(devices=sorted(set(devices))):
            for i in range(warmup + repeats):
                record = i >= warmup
                with torch.no_grad():
                    timed("forward", run, record, x)
                outs, grads = timed("forward_grad", graph, record)
                timed("backward", torch.autograd.backward, record, outs, grads)
                if split_backward and loss_fn is None and len(outs) > 1:
                    outs, grads = graph()
                    timed("backward_split", one_by_one, record, outs, grads)
                del outs, grads
        copies = [p.detach().clone().requires_grad_(True) for p in params]
        if not copies:
            timings["step"].append(0.0)
        opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3)))(copies) if copies else None
        for i in range(warmup + repeats if copies else 0):
            for c in copies:
                c.grad = torch.full_like(c, 1e-3)
            timed("step", opt.step, i >= warmup)
    finally:
        with torch.no_grad():
            for p, g in zip(params, saved_grads):
                p.grad = g
            for b, v in saved_buffers:
                b.copy_(v)
    return {name: statistics.median(values) for name, values in timings.items()}


def measure_layer_costs(layers: Sequence[Callable], x: Any, *, loss_fn: Callable | None = None, labels: Any = None,
                        repeats: int = 5, warmup: int = 1) -> list:
    """Per built layer, a :class:`petra_ds.pipeline.partition.LayerCost` measured in this process on ``x`` passed
    through the layers before it: :func:`measure_stage_costs`' forward, forward with a graph and backward
    (through ``loss_fn`` at the last layer), and a reversible layer's reconstruction from its output
    (median seconds). The model's state is left as it was."""
    from ..nn.reversible import is_reversible, reconstruct
    from ..pipeline.partition import LayerCost

    out = []
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        c = measure_stage_costs(layer, x, loss_fn=loss_fn if last else None, labels=labels if last else None,
                                input_grad=i > 0, split_backward=False, repeats=repeats, warmup=warmup)
        buffers = [(b, b.detach().clone()) for m in _modules(layer) for b in m.buffers()]
        with torch.no_grad():
            y = layer(x)
        rebuild = None
        if isinstance(layer, nn.Module) and is_reversible(layer) and not last:
            times = []
            for r in range(warmup + repeats):
                _sync(_tensors(y))
                t0 = time.perf_counter()
                with torch.enable_grad():
                    _x, tape = reconstruct(layer, _leaves(y, False))
                _sync(_tensors(y))
                if r >= warmup:
                    times.append(time.perf_counter() - t0)
                del _x, tape
            rebuild = statistics.median(times)
        with torch.no_grad():  # the batch-norm statistics as they were
            for b, saved in buffers:
                b.copy_(saved)
        out.append(LayerCost(c["forward"], c["forward_grad"], c["backward"], rebuild))
        x = y
    return out


def measure_message_seconds(x: Any, peer: int, *, first: bool, repeats: int = 20, warmup: int = 1,
                            group: Any = None) -> float:
    """Median seconds of one message ``x`` (a tensor or nested tensors) between this rank and ``peer``:
    half a round trip of blocking send/recv, the rank with ``first`` sending first. Both ranks call it."""
    import torch.distributed as tdist

    tensors = [t.detach().contiguous() for t in _tensors(x)]
    times = []
    for i in range(warmup + repeats):
        _sync(tensors)
        t0 = time.perf_counter()
        for phase in (first, not first):
            for t in tensors:
                (tdist.send if phase else tdist.recv)(t, peer, group)
        _sync(tensors)
        if i >= warmup:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def revnet_costs(depth: int, micro_batch: int = 32, *, image: int = 32, num_classes: int = 10,
                 base_width: int = 64, repeats: int = 5, seed: int = 0) -> tuple[Costs, list[bool], list[str]]:
    """Per-stage costs of RevNet-``depth`` cut one layer per stage (stem, residual blocks, head: the
    paper's 10 stages for RevNet18, 18 for RevNet34), measured in this process, train mode, with the
    SGD-with-momentum step of the recipe. Without ``backward_split``: the pipelines are the schedules
    themselves, not DeepSpeed's engine. Returns the costs, which stages are reversible and the layer names."""
    from ..models.revnet import revnet_layers
    from ..nn.reversible import is_reversible

    torch.manual_seed(seed)
    layers = [spec.build() for spec in revnet_layers(depth, num_classes, cifar=image <= 64, base_width=base_width)]
    x: Any = torch.randn(micro_batch, 3, image, image)
    labels = torch.randint(0, num_classes, (micro_batch,))
    stages = []
    for j, layer in enumerate(layers):
        layer.train()
        last = j == len(layers) - 1
        c = measure_stage_costs(layer, x, loss_fn=nn.functional.cross_entropy if last else None,
                                labels=labels if last else None, input_grad=j > 0, repeats=repeats,
                                split_backward=False,
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True))
        stages.append(StageCosts(**c))
        with torch.no_grad():
            x = layer(x)
    return Costs(tuple(stages)), [is_reversible(m) for m in layers], [type(m).__name__ for m in layers]

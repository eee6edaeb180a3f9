"""A small mixed reversible / non-reversible model and a multi-process runner, for tests and demos.

``launch(spec, world_size)`` starts ``world_size`` CPU processes (gloo), trains the toy model with
PetraEngine as ``spec`` says and returns what every rank recorded: the gradients each stage stepped
with, the final parameters by global name, the losses and, on request, a memory report per clock.
``run_processes`` does the same and reports each rank's exit, failed, killed or hung, for the tests where
a rank dies on purpose (spec keys ``kill_rank``, ``kill_at_clock``, ``kill_in_save``, ``kill_signal``).
"""

from __future__ import annotations

import datetime
import importlib
import io
import itertools
import json
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
from torch import nn

from .launch import free_port
from .module import layer_module
from .nn import AdditiveCoupling, SwapCoupling

WIDTH = 4
IN_FEATURES = 6
CLASSES = 3


def _mlp(dropout: float, batchnorm: bool = False) -> nn.Module:
    norm = [nn.BatchNorm1d(2 * WIDTH)] if batchnorm else []
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), *norm, nn.Tanh(), nn.Dropout(dropout),
                         nn.Linear(2 * WIDTH, WIDTH))


class Stem(nn.Module):
    """Non-reversible: features to a pair of streams."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(IN_FEATURES, 2 * WIDTH)

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        return y[:, :WIDTH], y[:, WIDTH:]


class Mix(nn.Module):
    """Non-reversible: mixes the two streams (a stand-in for a downsampling block)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * WIDTH, 2 * WIDTH)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        y = self.dropout(torch.tanh(self.linear(torch.cat(x, dim=1))))
        return y[:, :WIDTH], y[:, WIDTH:]


class Additive(AdditiveCoupling):
    def __init__(self, dropout: float = 0.0, batchnorm: bool = False) -> None:
        super().__init__(_mlp(dropout, batchnorm), _mlp(dropout, batchnorm))


class WrongInverse(Additive):
    """Declared reversible, but its inverse forgets G: the start-up check must refuse it."""

    def inverse(self, y):
        y1, y2 = y
        return y1 - self.F(y2), y2


class Swap(SwapCoupling):
    def __init__(self, dropout: float = 0.0, batchnorm: bool = False) -> None:
        super().__init__(_mlp(dropout, batchnorm))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, x):
        return self.linear(torch.cat(x, dim=1))


def toy_layer_specs(dropout: float = 0.0, batchnorm: bool = False) -> list:
    """Stem, Additive, Mix, Swap, Additive, Swap, Mix, Additive, Head (9 layers); ``batchnorm`` puts a
    BatchNorm1d inside every coupling's functions."""
    from deepspeed.runtime.pipe.module import LayerSpec

    bn = batchnorm
    return [
        LayerSpec(Stem), LayerSpec(Additive, dropout, bn), LayerSpec(Mix, dropout), LayerSpec(Swap, dropout, bn),
        LayerSpec(Additive, dropout, bn), LayerSpec(Swap, dropout, bn), LayerSpec(Mix),
        LayerSpec(Additive, dropout, bn), LayerSpec(Head),
    ]


def toy_data(num: int, micro_batch: int, seed: int = 0, dtype=torch.float64) -> list[tuple]:
    """``num`` global micro-batches of ``micro_batch`` samples; the label is the argmax of the first
    ``CLASSES`` features, so the toy model can learn it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        x = torch.randn(micro_batch, IN_FEATURES, generator=g, dtype=dtype)
        out.append((x, x[:, :CLASSES].argmax(dim=1)))  # a learnable rule
    return out


VOCAB, SEQ_LEN = 11, 6


def revgpt_tiny_config(dropout: float = 0.0, tie_embeddings: bool = False):
    """A RevGPT small enough for float64 oracles: 4 blocks, 7 layers."""
    from .models.transformer import RevGPTConfig

    return RevGPTConfig(vocab_size=VOCAB, seq_len=SEQ_LEN, d_model=8, n_layers=4, n_heads=2, mlp_ratio=2,
                        dropout=dropout, tie_embeddings=tie_embeddings)


def token_data(num: int, micro_batch: int, seed: int = 0, dtype=None) -> list[tuple]:
    """``num`` micro-batches of (ids, next ids) where the next token is the current one plus one
    (mod ``VOCAB``) most of the time: learnable, with some noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        start = torch.randint(0, VOCAB, (micro_batch, 1), generator=g)
        ids = (start + torch.arange(SEQ_LEN + 1)) % VOCAB
        noise = torch.rand(ids.shape, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(0, VOCAB, ids.shape, generator=g), ids)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def model_for(spec: dict[str, Any]) -> tuple[list, Any, Any]:
    """(layer specs, loss_fn, data function) of the test model ``spec["model"]``: "toy" or "revgpt"."""
    if spec.get("model", "toy") == "revgpt":
        from .models.transformer import lm_loss, revgpt_layers

        config = revgpt_tiny_config(spec["dropout"], spec.get("tie_embeddings", False))
        return revgpt_layers(config), lm_loss, token_data
    specs = toy_layer_specs(spec["dropout"], spec.get("batchnorm", False))
    if spec.get("wrong_inverse_at") is not None:
        from deepspeed.runtime.pipe.module import LayerSpec

        specs[spec["wrong_inverse_at"]] = LayerSpec(WrongInverse, spec["dropout"])
    return specs, nn.CrossEntropyLoss(), toy_data


DEFAULT_SPEC: dict[str, Any] = {
    "pipe": 1, "dp": 1, "stages_per_rank": 4, "k": 2, "micro_batch": 4, "train_batches": 3,
    "drain": True, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    "dropout": 0.1, "dtype": "float64", "petra": {}, "bf16": False, "base_seed": 1234, "data_seed": 0,
    "memory_trace": False, "capture_grads": True, "eval_batches": 0, "track_reconstruction": False,
}


def parameter_names(model: Any) -> dict[int, str]:
    """id(parameter) -> "<global layer index>.<name>", the names the tests' oracles use."""
    names = {}
    for i, layer in enumerate(model.forward_funcs):
        module = layer_module(layer)
        if module is not None:
            for name, p in module.named_parameters():
                names.setdefault(id(p), f"{model._local_start + i}.{name}")
    return names


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Train in this process (already launched as one rank) and return what it recorded."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    import petra_ds

    spec = {**DEFAULT_SPEC, **spec}
    dtype = getattr(torch, spec["dtype"])
    torch.set_default_dtype(dtype)
    timeout = datetime.timedelta(seconds=spec["dist_timeout"]) if spec.get("dist_timeout") else None
    petra_ds.init_distributed(dist_backend="gloo", timeout=timeout)
    topology = PipeDataParallelTopology(num_pp=spec["pipe"], num_dp=spec["dp"])
    layer_specs, loss_fn, data_fn = model_for(spec)
    model = petra_ds.PetraPipelineModule(
        layer_specs, topology=topology, loss_fn=loss_fn,
        stages_per_rank=spec["stages_per_rank"], partition_method="uniform", base_seed=spec["base_seed"])
    k, b, dp = spec["k"], spec["micro_batch"], spec["dp"]
    config = {
        "train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": k,
        "optimizer": spec["optimizer"], "steps_per_print": 10**9,
        "petra": {"stages_per_rank": spec["stages_per_rank"], **spec["petra"]},
    }
    if spec["bf16"]:
        config["bf16"] = {"enabled": True}
    config.update(spec.get("config", {}))
    model_parameters = None
    if spec.get("no_decay_on_bias"):  # the paper's recipe: no weight decay on biases
        named = list(model.named_parameters())
        model_parameters = [{"params": [p for n, p in named if not n.endswith("bias")]},
                            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
    client = {}
    if spec.get("client_optimizer"):  # callables, as users pass them to deepspeed.initialize
        lr, gamma = spec["client_optimizer"]["lr"], spec["client_optimizer"]["gamma"]
        config.pop("optimizer")
        client = {"optimizer": lambda groups: torch.optim.SGD(groups, lr=lr),
                  "lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)}
    engine, *_ = petra_ds.initialize(model=model, config=config, model_parameters=model_parameters, **client)
    for stage in engine.stages.values():
        stage.options.track_reconstruction = spec["track_reconstruction"]
    replica = engine.grid.data_parallel_id
    distinct = spec.get("distinct_micro_batches") or k * spec["train_batches"]
    data = [(x[replica * b:(replica + 1) * b], y[replica * b:(replica + 1) * b])
            for x, y in data_fn(distinct, b * dp, spec["data_seed"], dtype)]

    names = parameter_names(model)
    grads: dict[int, list[dict[str, torch.Tensor]]] = {j: [] for j in engine.stages}
    if spec["capture_grads"]:
        engine.step_observers.append(
            lambda j, st: grads[j].append({names[id(p)]: p.grad.detach().clone() for p in st.params}))
    memory: list[tuple[int, dict]] = []
    if spec["memory_trace"]:
        engine.clock_observers.append(lambda eng, clock: memory.append((clock, eng.memory_report())))
    if spec.get("load_dir"):
        engine.load_checkpoint(spec["load_dir"])
    if spec.get("nan_micro_batch") is not None:  # one micro-batch with a NaN feature
        x, y = data[spec["nan_micro_batch"]]
        x = x.clone()
        x[0, 0] = float("nan")
        data[spec["nan_micro_batch"]] = (x, y)
    if spec.get("bad_micro_batch") is not None:  # one micro-batch of another size
        bad = spec["bad_micro_batch"]
        data[bad] = (data[bad][0][:-1], data[bad][1][:-1])
    if spec.get("kill_rank") == engine.global_rank:
        _arm_kill(engine, spec)
    it = (data[m % distinct] for m in itertools.count(engine.timeline.feed.total))
    losses = []
    while engine.global_steps < spec["train_batches"]:
        losses.append(engine.train_batch(it).item())
        if spec.get("save_dir") and engine.global_steps == spec.get("save_after"):
            engine.save_checkpoint(spec["save_dir"], tag=spec.get("save_tag"))
        if spec.get("save_every") and engine.global_steps % spec["save_every"] == 0:
            engine.save_checkpoint(spec["save_dir"])
        if spec.get("eval_every"):
            engine.eval_batch(iter(data))
    if spec["drain"]:
        losses.append(engine.drain().item())
    evals = [engine.eval_batch(iter(data)).item() for _ in range(spec["eval_batches"])]
    params = {names[id(p)]: p.detach().clone() for p in model.parameters()}
    probe = None
    if spec.get("probe"):
        module_name, function = spec["probe"].split(":")
        probe = getattr(importlib.import_module(module_name), function)(engine)
    return {
        "probe": probe,
        "rank": engine.global_rank, "stages": sorted(engine.stages), "parts": model.petra_parts,
        "grads": grads, "params": params, "losses": losses, "evals": evals, "memory": memory,
        "clock": engine.clock, "stage_steps": dict(engine.stage_steps), "skipped_steps": engine.skipped_steps,
        "reconstructs": {j: st.reconstructs for j, st in engine.stages.items()},
        "reconstruction_errors": {j: list(st.reconstruction_errors) for j, st in engine.stages.items()},
    }


def _die(spec: dict[str, Any], what: str) -> None:
    """SIGKILL this process (no cleanup, no exception: what a crashed node looks like to its peers),
    after noting the wall-clock time for the test that measures how fast the others notice."""
    if spec.get("kill_record"):
        with open(spec["kill_record"], "w") as f:
            json.dump({"time": time.time(), "what": what, "pid": os.getpid()}, f)
    os.kill(os.getpid(), getattr(signal, spec.get("kill_signal", "SIGKILL")))


def _arm_kill(engine: Any, spec: dict[str, Any]) -> None:
    """Make this rank kill itself where ``spec`` says: at the end of clock ``kill_at_clock``, or inside
    its ``save``-th ``save_checkpoint`` (``kill_in_save = {"save": n, "at": ...}``) with ``at``
    "state" (half of its PETRA state file written) or "commit:i" (rank 0, just before the i-th
    ``os.replace`` of ``checkpoint.commit``)."""
    from . import checkpoint

    if spec.get("kill_at_clock") is not None:
        def observe(eng: Any, clock: int) -> None:
            if clock == spec["kill_at_clock"]:
                _die(spec, f"clock {clock}")

        engine.clock_observers.append(observe)
    where = spec.get("kill_in_save")
    if not where:
        return
    saves = itertools.count(1)
    if where["at"] == "state":
        atomic_save = checkpoint.atomic_save

        def torn_save(obj: Any, path: str) -> None:
            if next(saves) != where["save"]:
                return atomic_save(obj, path)
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            with open(f"{path}.tmp-{os.getpid()}", "wb") as f:
                f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
            _die(spec, f"writing {os.path.basename(path)}")

        checkpoint.atomic_save = torn_save
        return
    replace_at = int(where["at"].split(":")[1])
    commit = checkpoint.commit

    def dying_commit(*args: Any, **kwargs: Any) -> str:
        if next(saves) != where["save"]:
            return commit(*args, **kwargs)
        replaces = itertools.count(1)
        replace = os.replace

        def counted(src: str, dst: str) -> None:
            if next(replaces) == replace_at:
                _die(spec, f"commit before os.replace({src}, {dst})")
            replace(src, dst)

        os.replace = counted
        try:
            return commit(*args, **kwargs)
        finally:
            os.replace = replace

    checkpoint.commit = dying_commit


SHM_DIR, SHM_PREFIX = "/dev/shm", "deepspeed_allreduce_buffer"


def deepspeed_shm_buffers() -> set[str]:
    """Names of the shared-memory buffers DeepSpeed's CPU communication op has created (~66 MB each, one
    per process and launch, never unlinked)."""
    if not os.path.isdir(SHM_DIR):
        return set()
    return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}


def remove_deepspeed_shm_buffers(before: set[str]) -> None:
    """Unlink the buffers created since ``before`` was taken that no live process maps: those of processes
    that have exited. Hundreds of launches would otherwise fill the machine's memory. (Checking every
    process, not only this one, leaves alone the buffers of another launch that is still running.)"""
    left = deepspeed_shm_buffers() - before
    if not left:
        return
    mapped = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    mapped.append(f.read())
            except OSError:  # gone, or not ours to read
                continue
    maps = "".join(mapped)
    for name in left:
        if name not in maps:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


def _entry(rank: int, world: int, port: int, spec: dict, out_dir: str, target: Callable | None = None) -> None:
    os.environ.update(spec.get("env", {}))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        torch.save((target or run_rank)(spec), path)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, path)
        raise


def run_processes(spec: dict[str, Any], world_size: int | None = None, timeout: float = 300,
                  grace: float | None = None, target: Callable[[dict], Any] | None = None) -> list[dict]:
    """Run ``run_rank(spec)`` (or ``target(spec)``, a module-level function, with ``world_size`` given)
    in ``world_size`` fresh processes and report on each, failed or not: ``exitcode`` (negative: killed
    by that signal; None: still running at the deadline, then killed), ``ended`` (wall-clock time its
    exit was seen) and ``result`` or ``error`` (its traceback). The deadline is ``timeout``, or ``grace``
    seconds after the first process that fails, if sooner. ``spec["env"]`` is set in every process."""
    if target is None:
        spec = {**DEFAULT_SPEC, **spec}
        world = world_size or spec["pipe"] * spec["dp"]
    elif world_size is None:
        raise ValueError("run_processes with a target needs world_size")
    else:
        world = world_size
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_entry, args=(r, world, port, spec, out_dir, target)) for r in range(world)]
        for p in procs:
            p.start()
        ended: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while len(ended) < world and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and not p.is_alive():
                    ended[r] = time.time()
                    if p.exitcode and grace is not None:
                        deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.05)
        exitcodes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pt")
            saved = torch.load(path, weights_only=False) if os.path.exists(path) else {"error": "no result"}
            outcome = {"rank": r, "exitcode": exitcodes[r], "ended": ended.get(r)}
            outcome.update({"error": saved["error"]} if "error" in saved else {"result": saved})
            outcomes.append(outcome)
    return outcomes


def launch(spec: dict[str, Any], world_size: int | None = None, timeout: float = 300, grace: float | None = None,
           target: Callable[[dict], Any] | None = None) -> list[dict]:
    """Run ``run_rank(spec)`` (or ``target(spec)``) in ``world_size`` fresh processes; return their
    results by rank, or raise with every failed rank's traceback."""
    outcomes = run_processes(spec, world_size, timeout, grace, target)
    failed = [f"rank {o['rank']} failed:\n{o['error']}" for o in outcomes if "error" in o]
    if failed:  # every rank's error: the first one to fail is not always rank 0
        raise RuntimeError("\n".join(failed))
    return [o["result"] for o in outcomes]


def merged_params(results: list[dict]) -> dict[str, torch.Tensor]:
    """Parameters by global name over all ranks of data-parallel replica 0."""
    out: dict[str, torch.Tensor] = {}
    for result in results:
        for name, value in result["params"].items():
            out.setdefault(name, value)
    return out


def merged_grads(results: list[dict]) -> dict[int, list[dict[str, torch.Tensor]]]:
    out: dict[int, list] = {}
    for result in results:
        for j, steps in result["grads"].items():
            out.setdefault(j, steps)
    return out

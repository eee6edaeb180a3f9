"""The test-suite's training run and fault injection, on :mod:`petra_ds.tools.toy`'s models.

:func:`run_rank` trains the toy model (or a tiny RevGPT) with PetraEngine, in a process launched as one
rank, as ``spec`` says (keys and defaults: :data:`DEFAULT_SPEC`), and returns what the rank recorded: the
gradients each stage stepped with, the final parameters by global name, the losses and, on request, a
memory report per clock; :func:`run_example` runs an example script's ``main()`` in a rank instead.
:func:`launch` runs it (or another module-level ``target``) on every rank of a world: in the session's
pool of rank processes (``tests/pool.py``) unless asked for fresh processes, which runs that kill a
rank on purpose always get. :func:`run_processes` reports each rank's end, failed, killed or hung (spec
keys ``kill_rank``, ``kill_at_clock``, ``kill_in_save``, ``kill_signal``, ``kill_record``,
``dist_timeout``); ``nan_micro_batch``, ``bad_micro_batch`` and ``wrong_inverse_at`` inject a NaN
feature, a micro-batch of another size and a layer whose inverse is wrong.
"""

from __future__ import annotations

import datetime
import importlib
import io
import itertools
import json
import os
import signal
import time
from typing import Any, Callable

import torch
from torch import nn

from petra_ds.tools import spawn
from petra_ds.runtime.config import uses_muon
from petra_ds.pipeline.module import layer_module, petra_parts
from petra_ds.tools.toy import (Additive, decoder_tiny_config, revgpt_tiny_config, toy_data, toy_layer_specs,
                                token_data)


class WrongInverse(Additive):
    """Declared reversible, but its inverse forgets G: the start-up check must refuse it."""

    def inverse(self, y):
        y1, y2 = y
        return y1 - self.F(y2), y2


def image_data(num: int, micro_batch: int, seed: int = 0, dtype=torch.float64) -> list[tuple]:
    """``num`` micro-batches of random 3 x 8 x 8 images with labels in 10 classes (what RevNet's CIFAR stem takes)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(micro_batch, 3, 8, 8, generator=g, dtype=dtype),
             torch.randint(0, 10, (micro_batch,), generator=g)) for _ in range(num)]


def model_for(spec: dict[str, Any]) -> tuple[list, Any, Any]:
    """(layer specs, loss_fn, data function) of the test model ``spec["model"]``: "toy", "revgpt", "decoder"
    (a tiny reversible Llama) or "revnet" (RevNet18 with the CIFAR stem, base width ``spec["width"]``, default 4)."""
    if spec.get("model", "toy") == "revnet":
        from petra_ds.models.revnet import revnet_layers

        return revnet_layers(18, num_classes=10, cifar=True, base_width=spec.get("width", 4)), nn.CrossEntropyLoss(), \
            image_data
    if spec.get("model", "toy") == "decoder":
        from petra_ds.models.decoder import decoder_layers
        from petra_ds.models.transformer import lm_loss

        return decoder_layers(decoder_tiny_config(dropout=spec["dropout"])), lm_loss, token_data
    if spec.get("model", "toy") == "revgpt":
        from petra_ds.models.transformer import lm_loss, revgpt_layers

        config = revgpt_tiny_config(spec["dropout"], spec.get("tie_embeddings", False), spec.get("grain", "block"))
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
    """Train in this process (already launched as one rank) and return what it recorded; with
    ``spec["return_error"]``, an error that ends the run is returned as ``{"error": "<its type>: <its message>"}``
    instead of raised (a pooled world of one rank survives a run expected to fail)."""
    try:
        return _train(spec)
    except Exception as failure:
        if not spec.get("return_error"):
            raise
        return {"error": f"{type(failure).__name__}: {failure}"}


def _named(ref: str) -> Any:
    """The function ``"module:function"`` names (a spec's probe or setup)."""
    module_name, function = ref.split(":")
    return getattr(importlib.import_module(module_name), function)


def _train(spec: dict[str, Any]) -> dict[str, Any]:
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    import petra_ds

    spec = {**DEFAULT_SPEC, **spec}
    dtype = getattr(torch, spec["dtype"])
    torch.set_default_dtype(dtype)
    timeout = datetime.timedelta(seconds=spec["dist_timeout"]) if spec.get("dist_timeout") else None
    petra_ds.init_distributed(dist_backend="gloo", timeout=timeout)
    topology = PipeDataParallelTopology(num_pp=spec["pipe"], num_dp=spec["dp"])
    layer_specs, loss_fn, data_fn = model_for(spec)
    if spec.get("plain_module"):  # DeepSpeed's own class, as a DeepSpeed user builds it: one stage per rank
        from deepspeed.pipe import PipelineModule

        model = PipelineModule(layer_specs, topology=topology, loss_fn=loss_fn, partition_method="uniform",
                               seed_layers=True, base_seed=spec["base_seed"])
    else:
        model = petra_ds.PetraPipelineModule(
            layer_specs, topology=topology, loss_fn=loss_fn,
            stages_per_rank=spec["stages_per_rank"], partition_method="uniform", base_seed=spec["base_seed"])
    if spec.get("before_initialize"):  # "module:function", called with the model before the engine is built
        _named(spec["before_initialize"])(model)
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
    if uses_muon(config):
        torch._dynamo.config.disable = True  # DeepSpeed compiles Muon's kernel: eager, as the reference runs it
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
    hooks: list[tuple[str, int]] = []
    if spec.get("hook_order"):  # forwards_done and clock_end, in the order the engine calls them
        from petra_ds.runtime.observe import Observer

        class HookOrder(Observer):
            def forwards_done(self, eng: Any, clock: int) -> None:
                hooks.append(("forwards_done", clock))

            def clock_end(self, eng: Any, clock: int) -> None:
                hooks.append(("clock_end", clock))

        engine.observe(HookOrder())
    memory: list[tuple[int, dict]] = []
    if spec["memory_trace"]:
        engine.clock_observers.append(lambda eng, clock: memory.append((clock, eng.memory_report())))
    if spec.get("load_dir"):
        engine.load_checkpoint(spec["load_dir"])
    if spec.get("setup"):  # "module:function", called with the engine before it trains
        _named(spec["setup"])(engine)
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
    engine.wait_for_checkpoint()
    if spec["drain"]:
        losses.append(engine.drain().item())
    evals = [engine.eval_batch(iter(data)).item() for _ in range(spec["eval_batches"])]
    params = {names[id(p)]: p.detach().clone() for p in model.parameters()}
    probe = _named(spec["probe"])(engine) if spec.get("probe") else None
    return {
        "probe": probe, "hook_order": hooks,
        "rank": engine.global_rank, "stages": sorted(engine.stages), "parts": petra_parts(model),
        "grads": grads, "params": params, "losses": losses, "evals": evals, "memory": memory,
        "clock": engine.clock, "stage_steps": dict(engine.stage_steps), "skipped_steps": engine.skipped_steps,
        "reconstructs": {j: st.reconstructs for j, st in engine.stages.items()},
        "reconstruction_errors": {j: list(st.reconstruction_errors) for j, st in engine.stages.items()},
    }


def run_example(spec: dict[str, Any]) -> dict[str, Any]:
    """``examples/<spec["example"]>/train.py`` with the command line ``spec["argv"]``, in this process
    (launched as one rank): what a launcher's process runs (the script's ``run_main(main)``), without its
    seconds of imports when the rank is pooled. Returns the rank, what the run printed to stdout, and with
    ``spec["return_error"]`` the message of the error or exit that ended it (``"error"``, None when it
    ended normally) instead of raising it (the pooled world survives a run expected to fail)."""
    import contextlib
    import sys

    from petra_ds.tools.runs import run_main
    from subprocess_env import load_example

    script = load_example(spec["example"])
    argv = sys.argv
    sys.argv = [script.__file__, *spec["argv"]]
    error, printed = None, io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            run_main(script.main)
    except (Exception, SystemExit) as failure:
        if not spec.get("return_error"):
            raise
        error = str(failure)
    finally:
        sys.argv = argv
    return {"rank": int(os.environ["RANK"]), "error": error, "stdout": printed.getvalue()}


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
    "state" (half of its first PETRA state file written) or "commit:i" (rank 0, just before the i-th
    ``os.replace`` of ``checkpoint.commit``)."""
    from petra_ds.runtime import background_save, checkpoint

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

        saved_into: list[str] = []  # the partial directory of each save, in order

        def torn_save(obj: Any, path: str) -> None:
            if not os.path.basename(path).startswith("petra_stage-"):
                return atomic_save(obj, path)
            if os.path.dirname(path) not in saved_into:
                saved_into.append(os.path.dirname(path))
            if len(saved_into) != where["save"]:
                return atomic_save(obj, path)
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            with open(f"{path}.tmp-{os.getpid()}", "wb") as f:
                f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
            _die(spec, f"writing {os.path.basename(path)}")

        checkpoint.atomic_save = background_save.atomic_save = torn_save  # written here or by the save's thread
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


#: spec keys that make a rank kill itself or change how long its peers wait: always fresh processes
FAULT_KEYS = ("kill_rank", "dist_timeout")


def _world_size(spec: dict[str, Any], world_size: int | None, target: Callable | None) -> int:
    if world_size is not None:
        return world_size
    if target is not None:
        raise ValueError("a launch with a target needs world_size")
    spec = {**DEFAULT_SPEC, **spec}
    return spec["pipe"] * spec["dp"]


def run_processes(spec: dict[str, Any], world_size: int | None = None, timeout: float = 300,
                  grace: float | None = None, target: Callable[[dict], Any] | None = None) -> list[dict]:
    """:func:`petra_ds.tools.spawn.run_processes` of ``run_rank(spec)`` (or ``target(spec)``, ``world_size``
    given) in fresh processes: each rank's exit, result or error."""
    world_size = _world_size(spec, world_size, target)
    return spawn.run_processes(spec, world_size, timeout, grace, target=target or run_rank,
                               start_method=_fresh_start())


def _fresh_start() -> str:
    """Fresh processes fork from the pool's fork server (:func:`pool.context`: torch, DeepSpeed and the examples'
    imports loaded once), new processes that ran nothing before; ``spawn`` would import them again in each."""
    import pool

    pool.context()
    return "forkserver"


def launch(spec: dict[str, Any], world_size: int | None = None, timeout: float = 300, grace: float | None = None,
           target: Callable[[dict], Any] | None = None, fresh: bool | str = False) -> list[Any]:
    """Run ``run_rank(spec)`` (or ``target(spec)``, ``world_size`` given) on every rank; their results
    by rank, or a RuntimeError with every failed rank's traceback. The ranks are the session's pooled
    processes (:mod:`pool`) unless ``fresh`` or ``spec`` injects a fault (:data:`FAULT_KEYS`): then new
    processes forked from the pool's fork server, or started by ``fresh``'s method ("spawn") if it names one."""
    world_size = _world_size(spec, world_size, target)
    if fresh or any(spec.get(key) is not None for key in FAULT_KEYS):
        method = fresh if isinstance(fresh, str) else _fresh_start()
        return spawn.launch(spec, world_size, timeout, grace, target=target or run_rank, start_method=method)
    import pool

    return pool.launch(spec, world_size, timeout, grace, target=target or run_rank)


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


def assert_same_bits(got: list[dict], want: list[dict]) -> None:
    """Two runs of the same training (a memory or speed setting apart): parameters, every step's gradients and
    the losses bit for bit, on every rank."""
    params, params_ref = merged_params(got), merged_params(want)
    assert params.keys() == params_ref.keys()
    assert max((params[n] - params_ref[n]).abs().max().item() for n in params) == 0.0
    grads, grads_ref = merged_grads(got), merged_grads(want)
    assert grads.keys() == grads_ref.keys()
    for j in grads:
        assert len(grads[j]) == len(grads_ref[j]) > 0
        for step, step_ref in zip(grads[j], grads_ref[j], strict=True):
            assert all(torch.equal(step[n], step_ref[n]) for n in step_ref), j
    assert [[repr(x) for x in r["losses"]] for r in got] == [[repr(x) for x in r["losses"]] for r in want]

"""Functions run inside an engine process at the end of ``harness.run_rank`` (spec["probe"])."""


def _scheduler_steps(scheduler):
    if scheduler is None:
        return None
    if hasattr(scheduler, "last_batch_iteration"):  # DeepSpeed's schedulers count from -1
        return scheduler.last_batch_iteration + 1
    return scheduler.last_epoch  # torch's count from 0


def optimizers(engine):
    return {
        j: {
            "class": type(engine.stage_optimizers[i]).__name__,
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.stage_optimizers[i].param_groups],
            "group_sizes": [len(g["params"]) for g in engine.stage_optimizers[i].param_groups],
            "scheduler_steps": _scheduler_steps(engine.stage_schedulers[i]),
            "lr": engine.stage_optimizers[i].param_groups[0]["lr"],
            "stage_steps": engine.stage_steps[j],
        }
        for i, j in enumerate(engine.local_stage_ids)
    }


def batch_norm_updates(engine):
    """Per local stage: batches tracked by each of its batch norms, its backwards, its forwards."""
    from torch import nn

    fed = engine.timeline.feed
    out = {}
    for j, st in engine.stages.items():
        tracked = [int(m.num_batches_tracked) for mod in st.modules for m in mod.modules()
                   if isinstance(m, nn.BatchNorm1d)]
        forwards = sum(1 for m in range(fed.total) if m + j < engine.clock)
        out[j] = {"tracked": tracked, "backwards": st.backwards, "forwards": forwards}
    return out


def replica_view(engine):
    """What must agree or differ across data-parallel replicas: each local stage's output for one fixed
    input under micro-batch 0's keyed masks (training mode: dropout on, batch statistics), its running
    statistics and its parameters."""
    import torch

    from petra_ds.nn.batchnorm import running_stat_tensors
    from petra_ds.nn.reversible import as_tuple

    out = {}
    g = torch.Generator().manual_seed(0)
    x = None
    engine.module.train()
    for j in sorted(engine.stages):
        st = engine.stages[j]
        if x is None:
            x = torch.randn(8, 6, generator=g, dtype=torch.get_default_dtype())
        with st.scope(0, update_bn=False), torch.no_grad():
            y = st.run(x)
        out[j] = {"output": [t.clone() for t in as_tuple(y)],
                  "running_stats": [t.clone() for t in running_stat_tensors(st.norms)]}
        x = y
    return out


def modules_a_window_runs(engine):
    """The petra_ds modules whose Python code runs during one ``train_batch`` window (the pipeline already
    filled by the harness's run), seen by ``sys.setprofile``: every Python function call of this thread;
    and, under ``"engine_calls"``, the modules whose code the engine's own code calls directly."""
    import itertools
    import sys

    import torch

    from petra_ds.tools.toy import toy_data

    data = itertools.cycle(toy_data(4, engine.train_micro_batch_size_per_gpu(), 0, torch.get_default_dtype()))
    seen, called = set(), set()
    engine_module = type(engine).__module__

    def record(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("petra_ds."):
                seen.add(name)
                caller = frame.f_back.f_globals.get("__name__") if frame.f_back is not None else None
                if caller == engine_module and name != engine_module:
                    called.add(name)

    sys.setprofile(record)
    try:
        engine.train_batch(data)
    finally:
        sys.setprofile(None)
    return {"modules": sorted(seen), "engine_calls": sorted(called)}

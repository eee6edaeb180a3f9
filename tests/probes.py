"""Functions run inside an engine process at the end of ``petra_ds.testing.run_rank`` (spec["probe"])."""


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

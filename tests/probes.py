"""Functions run inside an engine process at the end of ``petra_ds.testing.run_rank`` (spec["probe"])."""


def optimizers(engine):
    return {
        j: {
            "class": type(engine.stage_optimizers[i]).__name__,
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.stage_optimizers[i].param_groups],
            "group_sizes": [len(g["params"]) for g in engine.stage_optimizers[i].param_groups],
            # DeepSpeed's schedulers count from -1
            "scheduler_steps": None if engine.stage_schedulers[i] is None
            else engine.stage_schedulers[i].last_batch_iteration + 1,
            "lr": engine.stage_optimizers[i].param_groups[0]["lr"],
            "stage_steps": engine.stage_steps[j],
        }
        for i, j in enumerate(engine.local_stage_ids)
    }

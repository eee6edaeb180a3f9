"""The examples' checkpoints (petra_ds.tools.run_checkpoints): only the newest few are kept, a damaged newest one
is named with what is wrong, and ``--resume auto`` falls back to the one before and continues from it."""

import itertools
import os

import torch

from harness import launch


def build_engine():
    import petra_ds
    from torch import nn

    from petra_ds.tools.runs import run_layout
    from petra_ds.tools.toy import toy_layer_specs

    layers = toy_layer_specs(dropout=0.0)
    layout = run_layout(len(layers))
    model = petra_ds.PetraPipelineModule(layers, topology=layout.topology(), loss_fn=nn.CrossEntropyLoss(),
                                         stages_per_rank=layout.stages_per_rank, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "petra": {"stages_per_rank": layout.stages_per_rank}}
    engine, *_ = petra_ds.initialize(model=model, config=config)
    return engine


def resume_outcome(engine, out: str, fall_back: bool) -> dict:
    from petra_ds.tools.run_checkpoints import resume

    try:
        state = resume(engine, out, fall_back=fall_back)
    except SystemExit as stop:
        return {"exit": stop.code}
    return {"state": state, "step": engine.global_steps,
            "params": [p.detach().clone() for p in engine.module.parameters()]}


def damage_and_resume(spec: dict) -> dict:
    """For each damage (one rank's PETRA state truncated, a layer file removed): three checkpoints kept two by
    two, the newest damaged, then resumed without and with falling back."""
    import petra_ds
    from deepspeed import comm as dist

    from petra_ds.tools.run_checkpoints import checkpoint_dir, save, tags
    from petra_ds.tools.toy import toy_data

    petra_ds.init_distributed()
    engine = build_engine()
    data = itertools.cycle(toy_data(4, 4, seed=0, dtype=torch.float32))
    results = {}
    for damage in ("truncate", "remove"):
        out = os.path.join(spec["out"], damage)
        saved = {}
        for step in (1, 2, 3):
            engine.train_batch(data)
            save(engine, out, {"step": step}, keep_last=2)
            saved[step] = [p.detach().clone() for p in engine.module.parameters()]
        dist.barrier()  # rank 0 prunes after its save
        kept = tags(checkpoint_dir(out))
        newest = sorted(os.listdir(checkpoint_dir(out)))[-2]  # the last save, whatever its step count
        if dist.get_rank() == 0:
            folder = os.path.join(checkpoint_dir(out), newest)
            if damage == "truncate":
                victim = os.path.join(folder, "petra_stage-07-data_00.pt")
                with open(victim, "r+b") as f:
                    f.truncate(os.path.getsize(victim) // 2)
            else:
                os.remove(os.path.join(folder, "layer_08-model_states.pt"))
        dist.barrier()
        for _ in range(2):  # move the parameters away from the checkpoints'
            engine.train_batch(data)
        results[damage] = {"kept": kept, "newest": newest, "strict": resume_outcome(engine, out, fall_back=False),
                           "fallen": resume_outcome(engine, out, fall_back=True), "step2": saved[2]}
    return results


def test_a_damaged_newest_checkpoint_is_named_and_the_run_falls_back(tmp_path):
    ranks = launch({"out": str(tmp_path)}, 2, target=damage_and_resume)
    for damage in ("truncate", "remove"):
        ckpt = tmp_path / damage / "checkpoints"
        first = ranks[0][damage]
        newest, older = ckpt / first["newest"], ckpt / first["kept"][1]
        wanted = (f"{newest / 'petra_stage-07-data_00.pt'} is truncated or corrupted" if damage == "truncate"
                  else f"{newest / 'layer_08-model_states.pt'} is missing")
        for rank, ranks_results in enumerate(ranks):
            result = ranks_results[damage]
            assert result["kept"] == [newest.name, older.name]  # --keep-last 2 removed the first of three
            assert sorted(os.listdir(ckpt)) == sorted([newest.name, older.name, "latest"])
            if rank == 0:  # the message: what is wrong, and the whole checkpoint to continue from
                message = result["strict"]["exit"]
                assert wanted in message and f"The newest whole checkpoint is {older}" in message, message
                assert "--resume auto" in message
            else:
                assert result["strict"] == {"exit": 2}
            fallen = result["fallen"]
            assert fallen["state"] == {"step": 2}
            for ours, saved in zip(fallen["params"], result["step2"], strict=True):
                assert torch.equal(ours, saved)

"""A checkpoint resumes on another placement of the same J PETRA stages (P ranks x stages_per_rank), bit for
bit: each stage's in-flight state, optimizer state and received messages load wherever the stage lives now."""

import os

import pytest
import torch

from harness import launch, merged_params
from petra_ds.runtime import checkpoint

ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}
TOY = {"k": 2, "train_batches": 10, "optimizer": ADAMW, "dropout": 0.1, "petra": {"input_buffer": "non_reversible"}}


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and bool(a) and all(torch.equal(a[n], b[n]) for n in a)


def placements(results: list[dict]) -> list[list[int]]:
    return [r["stages"] for r in results]


@pytest.mark.parametrize("save_after,pipe", [
    (3, 2),  # saved while the pipeline fills (J = 8, k = 2: the first micro-batch reaches the loss at clock 7)
    (6, 1),  # in steady state, resumed with all eight stages in one process
    pytest.param(3, 8, marks=pytest.mark.slow),
    pytest.param(6, 2, marks=pytest.mark.slow),
])
def test_the_toy_resumes_on_another_placement_bit_for_bit(tmp_path, save_after, pipe):
    """J = 8 on 4 ranks (4 x 2), saved mid-flight and resumed on ``pipe`` ranks (pipe x 8 / pipe): the parameters
    at the end equal the uninterrupted 4-rank run's bit for bit, through the same stage boundaries."""
    ckpt = str(tmp_path / "ckpt")
    whole = launch({"pipe": 4, "stages_per_rank": 2, **TOY, "save_dir": ckpt, "save_after": save_after})
    resumed = launch({"pipe": pipe, "stages_per_rank": 8 // pipe, **TOY, "load_dir": ckpt})
    assert placements(resumed) == [list(range(r * 8 // pipe, (r + 1) * 8 // pipe)) for r in range(pipe)]
    assert resumed[0]["parts"] == whole[0]["parts"]
    assert resumed[0]["clock"] == whole[0]["clock"]
    assert same_bits(merged_params(resumed), merged_params(whole))
    tag = f"global_step{save_after}"
    assert sorted(os.listdir(os.path.join(ckpt, tag))) == sorted(
        [f"layer_{i:02d}-model_states.pt" for i in range(9)] + [f"petra_stage-{j:02d}-data_00.pt" for j in range(8)])


def test_revgpt_with_tied_embeddings_moves_from_two_ranks_to_four_to_one(tmp_path):
    """RevGPT (J = 4, tied embedding and head, so the head's stage keeps a reader's copy of the embedding):
    2 x 2 saved, resumed on 4 x 1 and saved again, resumed on 1 x 4: bit for bit the uninterrupted 2-rank run."""
    common = {"model": "revgpt", "tie_embeddings": True, "k": 4, "train_batches": 9, "optimizer": ADAMW}
    first, second = str(tmp_path / "on2"), str(tmp_path / "on4")
    whole = launch({"pipe": 2, "stages_per_rank": 2, **common, "save_dir": first, "save_after": 3})
    middle = launch({"pipe": 4, "stages_per_rank": 1, **common, "load_dir": first, "save_dir": second,
                     "save_after": 6})
    last = launch({"pipe": 1, "stages_per_rank": 4, **common, "load_dir": second})
    assert placements(middle) == [[0], [1], [2], [3]] and placements(last) == [[0, 1, 2, 3]]
    assert same_bits(merged_params(middle), merged_params(whole))
    assert same_bits(merged_params(last), merged_params(whole))


@pytest.mark.parametrize("degrees", [(2, 1), pytest.param((1, 2), marks=pytest.mark.slow),
                                     pytest.param((2, 1, 2), marks=pytest.mark.slow)])
def test_a_run_resumes_on_another_data_parallel_degree_with_the_global_batch_kept(tmp_path, degrees):
    """J = 4 on 2 pipeline ranks, with dropout, and ``degrees[0]`` replicas of 4 / D rows each, saved mid-flight
    (FIFO entries, stage 0's micro-batches, messages, and at k = 4 stages 0 and 2 halfway through their
    accumulation), resumed on the next degree (and saved again): the same samples and the same dropout masks (each
    replica draws by the row blocks of the first degree), and the parameters at the end within 1e-6 relative of the
    uninterrupted run (float64; a mean over 4 rows against the mean of two means over 2). The global micro-batch
    must stay: the same degree change at the same micro-batch size is refused, naming both."""
    first, *later = degrees
    common = {"pipe": 2, "stages_per_rank": 2, "k": 4, "train_batches": 6, "dropout": 0.1,
              "petra": {"input_buffer": "non_reversible"}}  # SGD with momentum (Adam divides rounding by ~0)
    ckpt = str(tmp_path / "ckpt0")
    whole = launch({**common, "dp": first, "micro_batch": 4 // first, "save_dir": ckpt, "save_after": 2})
    for hop, dp in enumerate(later, 1):
        saving = {"save_dir": str(tmp_path / f"ckpt{hop}"), "save_after": 4} if hop < len(later) else {}
        resumed = launch({**common, "dp": dp, "micro_batch": 4 // dp, "load_dir": ckpt, **saving})
        ckpt = saving.get("save_dir", ckpt)
    assert len(resumed) == 2 * later[-1] and resumed[0]["clock"] == whole[0]["clock"]
    want, got = merged_params(whole), merged_params(resumed)
    assert want.keys() == got.keys() and want
    for name in want:
        error = (got[name] - want[name]).abs().max() / want[name].abs().max()
        assert error <= 1e-6, (name, float(error))
    before, after = degrees[-2:]
    refused = launch({**common, "dp": after, "micro_batch": 4 // before, "load_dir": ckpt, "return_error": True})
    message = refused[0]["error"]
    assert f"data_parallel: {before} in the checkpoint, {after} in this run" in message, message
    assert "train_micro_batch_size_per_gpu" in message, message


def test_what_must_match_is_named_and_the_placement_is_not(tmp_path):
    """Resuming with another k or another training setting is refused naming each difference; the number of
    ranks is not among them."""
    ckpt = str(tmp_path / "ckpt")
    launch({"pipe": 2, "stages_per_rank": 2, "k": 2, "train_batches": 2, "save_dir": ckpt, "save_after": 2})
    (refused,) = launch({"pipe": 1, "stages_per_rank": 4, "k": 4, "train_batches": 3, "load_dir": ckpt,
                         "petra": {"param_buffer": True}, "return_error": True})
    message = refused["error"]
    assert "k: 2 in the checkpoint, 4 in this run" in message, message
    assert "petra.param_buffer: False in the checkpoint, True in this run" in message, message
    assert "pipe" not in message and "stages_per_rank:" not in message, message


def test_a_checkpoint_written_per_rank_is_refused_on_another_layout_naming_what_differs(tmp_path):
    """tests/fixtures/checkpoint_before_move (one state file per rank, 2 ranks x 2 stages) loads on its own layout
    (test_architecture); on 1 x 4 it is refused, naming the rank count and stages_per_rank."""
    import shutil

    from subprocess_env import ROOT

    load_dir = tmp_path / "ckpt"
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "checkpoint_before_move"), load_dir)
    spec = dict(model="revgpt", tie_embeddings=True, k=2, micro_batch=2, dropout=0.1, train_batches=3)
    (refused,) = launch({**spec, "pipe": 1, "stages_per_rank": 4, "load_dir": str(load_dir), "return_error": True})
    message = refused["error"]
    assert "pipe: 2 in the checkpoint, 1 in this run" in message, message
    assert "stages_per_rank: 2 in the checkpoint, 4 in this run" in message, message
    assert "resumes on the same layout" in message, message


class RunsCode:
    """Unpickling this runs ``os.system``: what a crafted checkpoint would do."""

    def __reduce__(self):
        return (os.system, ("touch ran-code",))


def test_a_checkpoint_file_that_would_run_code_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "petra_stage-00-data_00.pt")
    torch.save({"format": 2, "stage": RunsCode()}, path)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="petra_stage-00-data_00.pt holds more than tensors"):
        checkpoint.load_file(path)
    assert not (tmp_path / "ran-code").exists()


def test_no_load_in_the_package_unpickles_arbitrary_objects():
    """Every ``torch.load`` in petra_ds reads tensors and plain values only (``weights_only=True``)."""
    from subprocess_env import ROOT

    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "petra_ds")):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                if "weights_only=False" in text:
                    offenders.append(os.path.join(folder, name))
    assert offenders == []

"""examples/reformer/train.py end to end on text files made here: data, tokenizer, training, export."""

import json
import os
import subprocess
import sys

import pytest
import torch

from petra_ds.launch import free_port
from subprocess_env import ROOT, launcher_env

from test_text_data import corpus


def _files(tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(corpus(300)) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(corpus(40, seed=1)) + "\n")
    return [str(tmp_path / "train.txt"), str(tmp_path / "valid.txt")]


def _run(cmd, out):
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (out / "curves.png").stat().st_size > 1000
    return summary, rows


SMALL = ["--seq-len", "16", "--max-steps", "4", "--eval-every", "2", "--d-model", "16", "--layers", "2",
         "--heads", "2", "--vocab-size", "300", "--eval-batches", "3"]


def test_reformer_one_process_trains_and_exports_a_hugging_face_model(tmp_path):
    from transformers import AutoTokenizer, ReformerModelWithLMHead

    out, export = tmp_path / "run", tmp_path / "hf"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "reformer", "train.py"), "--deepspeed_config",
           os.path.join(ROOT, "ds_configs", "petra_lm.json"), "--model", "reformer", "--data-files", *_files(tmp_path),
           *SMALL, "--output-dir", str(out), "--export-hf", str(export)]
    summary, rows = _run(cmd, out)
    assert summary["method"] == "petra" and summary["model"] == "reformer" and summary["stages"] == 4
    assert [r["step"] for r in rows] == [2, 4]
    assert all(abs(r["val_perplexity"] - torch.tensor(r["val_loss"]).exp().item()) < 1e-3 * r["val_perplexity"]
               for r in rows)
    assert summary["memory_rank0"]["1"]["input_buffer_peak"] == 0  # reversible stages keep no inputs
    model = ReformerModelWithLMHead.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = torch.tensor([tokenizer("the reversible stage sends its gradient")["input_ids"][:16]])
    ids = torch.nn.functional.pad(ids, (0, 16 - ids.shape[1]), value=tokenizer.eos_token_id)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 16, model.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.slow
@pytest.mark.parametrize("config,method", [("petra_lm.json", "petra"), ("backprop_lm.json", "backprop")])
def test_revgpt_two_processes_with_tied_embeddings(tmp_path, config, method):
    out = tmp_path / "run"
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "reformer", "train.py"), "--deepspeed_config",
           os.path.join(ROOT, "ds_configs", config), "--model", "revgpt", "--tie-embeddings",
           "--data-files", *_files(tmp_path), *SMALL, "--stages", "4", "--output-dir", str(out)]
    summary, rows = _run(cmd, out)
    assert summary["method"] == method and summary["world_size"] == 2
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] + 1.0 and rows[-1]["tokens_per_s"] > 0

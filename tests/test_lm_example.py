"""examples/reformer/train.py end to end on text files made here: data, tokenizer, training, export."""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from petra_ds.runtime.config import MUON_LR_RATIO
from petra_ds.runtime.distributed import free_port
from subprocess_env import ROOT, launcher_env

from test_text_data import corpus


def _files(tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(corpus(300)) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(corpus(40, seed=1)) + "\n")
    return [str(tmp_path / "train.txt"), str(tmp_path / "valid.txt")]


def _run(cmd, out):
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _outputs(out)


def _example(argv):
    """examples/reformer/train.py with ``argv`` on one pooled rank: its stdout and the message it exited with."""
    from harness import launch, run_example

    return launch({"example": "reformer", "argv": argv, "return_error": True}, world_size=1, target=run_example)[0]


def _outputs(out):
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (out / "curves.png").stat().st_size > 1000
    return summary, rows


SMALL = ["--seq-len", "16", "--max-steps", "4", "--eval-every", "2", "--d-model", "16", "--layers", "2",
         "--heads", "2", "--vocab-size", "300", "--eval-batches", "3"]


def test_reformer_one_process_trains_and_exports_a_hugging_face_model(tmp_path):
    from transformers import AutoTokenizer, ReformerModelWithLMHead

    out, export, baseline = tmp_path / "run", tmp_path / "hf", tmp_path / "backprop"
    with open(os.path.join(ROOT, "ds_configs", "backprop_lm.json")) as f:  # a backprop run's summary, as written
        baseline.mkdir()
        (baseline / "summary.json").write_text(json.dumps({"method": "backprop", "final_val_loss": 5.0,
                                                          "config": json.load(f)}))
    ran = _example(["--deepspeed_config", os.path.join(ROOT, "ds_configs", "petra_lm.json"), "--model", "reformer",
                    "--data-files", *_files(tmp_path), *SMALL, "--output-dir", str(out), "--export-hf", str(export),
                    "--baseline", str(baseline)])
    assert ran["error"] is None, ran["error"]
    summary, rows = _outputs(out)
    compared = summary["against_baseline"]
    assert compared["same_optimizer"] and compared["gap"] == pytest.approx((summary["final_val_loss"] - 5.0) / 5.0)
    assert compared["label"] in ran["stdout"]
    assert summary["method"] == "petra" and summary["model"] == "reformer" and summary["stages"] == 4
    # petra_lm.json's 16 sequences per step, split for J = 4: k = 8 >= 2(J-1)
    assert (summary["config"]["train_micro_batch_size_per_gpu"], summary["config"]["gradient_accumulation_steps"]) \
        == (2, 8)
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


@pytest.mark.parametrize("config,rule,grain", [("petra_lm.json", "petra", "block"), ("backprop_lm.json", "backprop", "half")])
def test_profile_partition_cuts_petra_and_its_baseline_from_one_costs_file(tmp_path, config, rule, grain):
    """--partition profile on two pooled ranks, tied embeddings: every layer measured once into a whole
    file; PETRA (J = 4 stages) and DeepSpeed's 1F1B (2 stages) each cut it by their own rule, as
    recomputed here (the baseline from the blocks' halves, --grain half). A costs file for another model is
    refused before training."""
    from harness import launch, run_example
    from petra_ds.pipeline.partition import balanced_parts, load_costs, save_costs

    out = tmp_path / "run"
    argv = ["--deepspeed_config", os.path.join(ROOT, "ds_configs", config), "--model", "revgpt", "--tie-embeddings",
            "--data-files", *_files(tmp_path), *SMALL, "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1",
            "--partition", "profile", "--grain", grain, "--output-dir", str(out)]
    launch({"example": "reformer", "argv": argv}, world_size=2, target=run_example)
    summary = json.loads((out / "summary.json").read_text())
    costs_file = out / "layer_costs.json"
    costs = load_costs(str(costs_file))
    assert [p.name for p in out.iterdir() if p.name.startswith("layer_costs")] == ["layer_costs.json"]
    blocks = 2 if grain == "block" else 4
    assert len(costs) == blocks + 3 and all(c.forward > 0 and c.forward_grad > 0 and c.backward > 0 for c in costs)
    # embedding, two reversible blocks (or their four halves), final norm, tied head
    assert [c.reconstruct is not None for c in costs] == [False] + [True] * blocks + [False, False]
    stages = 4 if rule == "petra" else 2
    assert summary["stages"] == stages
    assert summary["partition"] == {"method": "profile", "layer_costs": str(costs_file),
                                    "parts": balanced_parts(costs, stages, "non_reversible", rule=rule)}
    if rule == "backprop":
        return
    save_costs(costs[:3], str(tmp_path / "short.json"))
    failed = launch({"example": "reformer", "argv": [*argv, "--layer-costs", str(tmp_path / "short.json")],
                     "return_error": True}, world_size=2, target=run_example)
    assert [r["error"] for r in failed] == ["layer_costs has 3 entries for 5 layer specs; give one per layer spec, "
                                            "in order"] * 2


def test_a_global_batch_is_split_for_the_depth_and_muon_comes_from_the_command_line(tmp_path):
    """--global-batch 16 at J = 4 becomes micro-batch 2 x k = 8 (stage 0 exactly one step behind); --optimizer
    replaces the config's optimizer, --lr fills its lr and Muon's is MUON_LR_RATIO x it; the run trains and records it.
    --eval-sequences 12 validates on the first 12 held-out sequences (6 micro-batches of 2), and the final
    weights, read back by lm_accuracy's revalidation, give the run's own final validation loss."""
    from subprocess_env import load_benchmark

    out = tmp_path / "run"
    muon = {"type": "muon", "params": {"momentum": 0.95, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                       "torch_adam": True}}
    small = SMALL[:SMALL.index("--eval-batches")]  # its last two: the held-out text is given in sequences here
    ran = _example(["--deepspeed_config", os.path.join(ROOT, "ds_configs", "petra_lm.json"), "--model", "revgpt",
                    "--data-files", *_files(tmp_path), *small, "--eval-sequences", "12", "--stages", "4",
                    "--global-batch", "16", "--optimizer", json.dumps(muon), "--lr", "2e-3", "--output-dir", str(out)])
    assert ran["error"] is None, ran["error"]
    summary, rows = _outputs(out)
    config = summary["config"]
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 8)
    assert [r["val_sequences"] for r in rows] == [12, 12]
    bench = load_benchmark("lm_accuracy")
    assert bench.validated_sequences(summary) == 12
    assert bench.final_loss_on(str(out), summary, 12, str(tmp_path)) == pytest.approx(summary["final_val_loss"],
                                                                                     abs=1e-5)
    assert config["optimizer"]["type"] == "muon"
    assert config["optimizer"]["params"]["lr"] == 2e-3
    assert config["optimizer"]["params"]["muon_lr"] == pytest.approx(MUON_LR_RATIO * 2e-3)
    assert all(torch.isfinite(torch.tensor(r["val_loss"])) for r in rows)


def test_resume_never_starts_over_silently(tmp_path):
    """--resume without a checkpoint stops and names the folder it looked in; --resume auto starts fresh and
    says so; --stop-after without --save-every warns that nothing will be saved."""
    out = tmp_path / "run"
    base = ["--deepspeed_config", os.path.join(ROOT, "ds_configs", "backprop_lm.json"), "--model", "revgpt",
            "--data-files", *_files(tmp_path), *SMALL, "--output-dir", str(out)]
    assert _example(base + ["--resume"])["error"].startswith(
        f"--resume: no checkpoint to resume from in {out / 'checkpoints'}")
    ran = _example(base + ["--resume", "auto", "--stop-after", "2"])
    assert ran["error"] is None, ran["error"]
    assert f"--resume auto: no checkpoint in {out / 'checkpoints'}; starting fresh" in ran["stdout"]
    assert "--stop-after 2 without --save-every writes no checkpoint" in ran["stdout"]


def test_from_pretrained_without_its_tokenizer_is_refused(tmp_path):
    ran = _example(["--deepspeed_config", os.path.join(ROOT, "ds_configs", "petra_lm.json"), "--model", "reformer",
                    "--from-pretrained", str(tmp_path / "my-reformer"), "--data-files", *_files(tmp_path),
                    "--output-dir", str(tmp_path / "run")])
    assert f"add --tokenizer {tmp_path / 'my-reformer'}" in ran["error"]


def test_a_configuration_error_is_one_line_not_a_traceback(tmp_path):
    """The example's run_main ends a configuration error as SystemExit with one line (Python prints its message
    and no traceback; tests/test_layout.py sees that in a real interpreter)."""
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                  "petra": {"delay_compensation": "nesterov"}}))
    argv = ["--model", "revgpt", "--data-files", *_files(tmp_path), *SMALL, "--output-dir", str(tmp_path / "run")]
    error = _example(["--deepspeed_config", str(config), *argv])["error"]
    assert error.startswith('configuration error: "petra.delay_compensation.method" must be one of')
    assert "\n" not in error
    error = _example(["--deepspeed_config", os.path.join(ROOT, "ds_configs", "petra_lm.json"), *argv,
                      "--model", "reformer", "--grain", "half"])["error"]
    assert error.endswith("(a Reformer block stays whole)")


@pytest.mark.parametrize("grain", ["block", "half"])
def test_decoder_on_two_ranks_generates_and_loads_back_with_from_pretrained(tmp_path, grain):
    """--model decoder (a reversible Llama with grouped-query attention and a tied head, from Hugging Face's modules),
    J = 4 PETRA stages on two pooled ranks: the gathered model's greedy sample is in summary.json, and the exported
    model, loaded the usual way, continues the same prompt with the same tokens. At --grain half its blocks are
    attention and MLP halves, and the export says so."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import petra_ds.models.causal_lm  # noqa: F401  (registers the model with AutoModelForCausalLM)
    from harness import launch, run_example

    out, export = tmp_path / "run", tmp_path / "hf"
    files = _files(tmp_path)
    valid = tmp_path / "valid.txt"
    valid.write_text("a b\n" + valid.read_text())  # the prompt holds an end of text, the id generate() pads with
    argv = ["--deepspeed_config", os.path.join(ROOT, "ds_configs", "petra_lm.json"), "--model", "decoder",
            "--data-files", *files, *SMALL, "--stages", "4", "--kv-heads", "1", "--tie-embeddings",
            "--output-dir", str(out), "--export-hf", str(export), "--grain", grain]
    launch({"example": "reformer", "argv": argv}, world_size=2, target=run_example)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "decoder" and summary["stages"] == 4 and summary["world_size"] == 2
    sample = summary["sample"]
    assert len(sample["prompt_ids"]) == 8 and len(sample["ids"]) == 8 and isinstance(sample["text"], str)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    attention = model.blocks[0].F.self_attn
    assert attention.num_key_value_groups == 2  # 2 query heads, 1 key/value head
    kinds = {"block": ["DecoderBlock"] * 2, "half": ["DecoderAttentionHalf", "DecoderMLPHalf"] * 2}[grain]
    assert model.config.grain == grain and [type(b).__name__ for b in model.blocks] == kinds
    assert model.tied and model.head is None
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.eos_token_id in sample["prompt_ids"]
    prompt = torch.tensor([sample["prompt_ids"]])
    again = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8,
                           do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert again[0, 8:].tolist() == sample["ids"]


@pytest.mark.slow
def test_decoder_starts_from_a_plain_llama_checkpoint(tmp_path):
    """--model decoder --from-pretrained: a plain LlamaForCausalLM's tensors start the reversible layers of the same
    names (lr 0 keeps them, to compare after export)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import petra_ds.models.causal_lm  # noqa: F401  (registers the model with AutoModelForCausalLM)
    from harness import launch, run_example

    files = _files(tmp_path)
    base = ["--deepspeed_config", os.path.join(ROOT, "ds_configs", "petra_lm.json"), "--model", "decoder",
            "--data-files", *files, *SMALL, "--stages", "4", "--max-steps", "2", "--sample-tokens", "0"]
    launch({"example": "reformer", "argv": [*base, "--output-dir", str(tmp_path / "run")]}, world_size=2,
           target=run_example)
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    plain.save_pretrained(tmp_path / "plain")
    tokenizer_dir = next((tmp_path / "run").glob("tokenizer-bpe-*"))
    argv = [*base, "--output-dir", str(tmp_path / "run2"), "--from-pretrained", str(tmp_path / "plain"),
            "--tokenizer", str(tokenizer_dir), "--lr", "0", "--export-hf", str(tmp_path / "hf")]
    launch({"example": "reformer", "argv": argv}, world_size=2, target=run_example)
    started = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(started.embed.embed_tokens.weight, plain.model.embed_tokens.weight)
    assert torch.equal(started.blocks[1].G.mlp.up_proj.weight, plain.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(started.head.lm_head.weight, plain.lm_head.weight)


def test_eval_sequences_fix_the_held_out_text_whatever_the_micro_batch():
    """The same sequences for micro-batches 1, 2 and 4; a count the micro-batch does not divide is refused with
    the fix; --eval-batches still counts micro-batches; the default is the largest multiple of the micro-batch
    up to EVAL_SEQUENCES."""
    from subprocess_env import load_example

    train = load_example("reformer")
    args = argparse.Namespace(eval_sequences=120, eval_batches=None)
    assert [train.validation_batches(args, micro) * micro for micro in (1, 2, 4, 8)] == [120] * 4
    with pytest.raises(SystemExit, match="--eval-sequences 120 is not a multiple of the micro-batch size 16"):
        train.validation_batches(args, 16)
    args.eval_sequences, args.eval_batches = None, 3
    assert train.validation_batches(args, 16) == 3
    args.eval_batches = None
    assert train.validation_batches(args, 4) == train.EVAL_SEQUENCES // 4
    assert train.validation_batches(args, 16) * 16 == 16 * (train.EVAL_SEQUENCES // 16)


def test_fp16_on_two_ranks_reports_every_stage_s_skips_and_scale(tmp_path):
    """The decoder under fp16 from scale 2^24 (its first steps overflow; hysteresis 1), J = 4 on two pooled ranks:
    summary.json lists the skipped steps of the stages on both ranks and each stage's scale, lowered once per skip."""
    from harness import launch, run_example

    with open(os.path.join(ROOT, "ds_configs", "petra_lm.json")) as f:
        config = {**json.load(f), "fp16": {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}}
    (tmp_path / "fp16.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    argv = ["--deepspeed_config", str(tmp_path / "fp16.json"), "--model", "decoder", "--data-files", *_files(tmp_path),
            *SMALL, "--stages", "4", "--output-dir", str(out), "--sample-tokens", "0"]
    launch({"example": "reformer", "argv": argv}, world_size=2, target=run_example)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["precision"].startswith("fp16, dynamic loss scale per stage from 2^24")
    skipped = [tuple(s) for s in summary["skipped"]]
    assert summary["skipped_steps"] == len(skipped) > 0 and {0, 3} <= {j for j, _ in skipped}
    assert sorted(summary["loss_scales"]) == ["0", "1", "2", "3"]
    for j, scale in summary["loss_scales"].items():
        assert scale == 2.0 ** (24 - sum(stage == int(j) for stage, _ in skipped)), (j, skipped)
    assert math.isfinite(summary["final_val_loss"])

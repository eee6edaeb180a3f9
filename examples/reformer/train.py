"""Train a reversible language model (RevGPT, a Hugging Face Reformer or a reversible Llama/Qwen/Mistral-style
decoder) with PETRA or DeepSpeed's 1F1B, then generate a sample from it.

    deepspeed --num_gpus 4 examples/reformer/train.py --deepspeed_config ds_configs/petra_lm.json \\
        --model revgpt --data-files train.txt valid.txt --seq-len 256
    deepspeed --num_gpus 4 examples/reformer/train.py --deepspeed_config ds_configs/backprop_lm.json ...
    torchrun --nproc_per_node 2 examples/reformer/train.py ...
    python examples/reformer/train.py ...            # one process, all stages
    ... --model reformer --reformer-config path/to/config.json   # or --from-pretrained a local model dir
    ... --model decoder --hf-config examples/reformer/llama_d256.json   # Hugging Face's Llama modules, reversible
    ... --dataset wikitext --dataset-config wikitext-103-raw-v1 --tokenizer gpt2        # online

A config with a "petra" section trains with PETRA; one without with DeepSpeed's synchronous 1F1B.
With PETRA, the config's global batch (micro-batch x k) is split into k >= 2(J-1) micro-batches when its own k is
smaller (petra_lm.json's 4 x 4 at J = 4: 2 x 8), so that stage 0 is at most one optimizer step behind; the run
says so, and ``--micro-batches 4`` keeps the config's split.
The layout fits the processes launched (petra_ds.tools.runs.choose_layout; rank 0 prints it): without --stages
and --data-parallel, the fewest data-parallel replicas that leave at most one pipeline rank per layer and
as many PETRA stages per rank as the layers allow (the default RevGPT's 11 layers on 4 processes: J = 8,
three stages of two layers; on one process: J = 11).
Without an "optimizer" section torch's fused AdamW (betas 0.9 / 0.95, weight decay 0.01: nothing to compile on a
GPU) is used; --lr fills the
optimizer's lr unless the config sets one (with DeepSpeed's "muon", the hidden matrices get 10x it unless
the config sets "muon_lr"), and without a "scheduler" section the lr warms up over --warmup-steps and then
decays to 0 on a cosine. Text comes through
Hugging Face ``datasets``; the tokenizer is a byte-level BPE trained on the training text (offline
default), plain bytes, or any ``AutoTokenizer`` name/path.

At the end the pipeline's weights are gathered on rank 0 (through a DeepSpeed checkpoint, <output-dir>/checkpoint)
into a Hugging Face model, which greedily continues the first validation tokens (``--sample-tokens``; 0: no
sample); the text goes to the console and summary.json. ``--export-hf DIR`` saves that model and its tokenizer
(``save_pretrained``): a Reformer as Hugging Face's ``ReformerModelWithLMHead``, RevGPT and the decoder as
``petra_ds.models.causal_lm`` models that ``AutoModelForCausalLM.from_pretrained`` loads once that module is
imported.

``--save-every N`` checkpoints to <output-dir>/checkpoints every N train_batch calls; ``--resume`` continues
from the latest one: step count, optimizer and LR schedule, the data stream's position, metrics.jsonl (an
error when there is none; ``--resume auto`` starts fresh then).

``--partition profile`` cuts the layers where the stages' measured costs balance instead of "uniform"
(petra_ds.tools.run_partition): rank 0 times every layer on one training micro-batch and writes
<output-dir>/layer_costs.json, which every rank cuts from (``--layer-costs FILE`` reuses an earlier one);
the 1F1B baseline is cut from the same costs, balanced for its own schedule. summary.json records the
partition: method, layer boundaries, costs file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import contextmanager

import deepspeed
import torch
from deepspeed import comm as dist
from tqdm import tqdm

import petra_ds
from petra_ds.runtime.config import MUON_LR_RATIO, uses_muon
from petra_ds.data.text import build_tokenizer, lm_loader, lm_stream, load_text, pack
from petra_ds.models.transformer import RevGPTConfig, lm_loss
from petra_ds.tools.run_partition import agreed_partition, baseline_module, shared_layer_costs
from petra_ds.tools.run_checkpoints import finish as finish_checkpoints, resume, save
from petra_ds.tools.runs import (RunFiles, add_run_arguments, against_baseline, apply_global_batch, apply_run_arguments,
                                 run_layout, run_main, skipped_steps)


#: held-out sequences per evaluation when the command line names none
EVAL_SEQUENCES = 200


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="revgpt", choices=["revgpt", "reformer", "decoder"])
    p.add_argument("--data-files", nargs="+", default=None, help="local text files (names with valid/test: held out)")
    p.add_argument("--dataset", default=None, help="a Hugging Face hub data set (online)")
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--text-column", default="text")
    p.add_argument("--tokenizer", default="bpe", help="bpe (trained here), bytes, or an AutoTokenizer name/path")
    p.add_argument("--vocab-size", type=int, default=4096, help="for --tokenizer bpe")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-steps", type=int, default=1000, help="train_batch calls")
    p.add_argument("--eval-every", type=int, default=100)
    held = p.add_mutually_exclusive_group()
    held.add_argument("--eval-sequences", type=int, default=None,
                      help="held-out sequences per evaluation, the first N whatever the micro-batch size, so that runs "
                           "with other micro-batch sizes see the same text; a multiple of the micro-batch size "
                           f"(default: {EVAL_SEQUENCES}, or the largest multiple below it)")
    held.add_argument("--eval-batches", type=int, default=None,
                      help="held-out micro-batches per evaluation instead (their sequences depend on the micro-batch size)")
    p.add_argument("--output-dir", default="runs/lm")
    p.add_argument("--seed", type=int, default=0)
    add_run_arguments(p)
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate, unless the config's optimizer sets one")
    p.add_argument("--optimizer", default=None, metavar="JSON",
                   help='replaces the config\'s "optimizer" section, e.g. \'{"type": "NAdam", "params": {"betas": '
                        '[0.99, 0.95], "momentum_decay": 1e9, "decoupled_weight_decay": true}}\'')
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--grain", choices=["block", "half"], default="block",
                   help="--model revgpt or decoder: one pipeline layer per block, or its attention and MLP halves (two "
                        "layers the partition may cut between: a finer balance with --partition profile)")
    p.add_argument("--reformer-config", default=None, help="a ReformerConfig (config.json or its directory)")
    p.add_argument("--from-pretrained", default=None,
                   help="a local model directory: a ReformerModelWithLMHead (--model reformer) or a plain Llama/Qwen/"
                        "Mistral causal LM (--model decoder: its tensors start the reversible layers of the same names)")
    p.add_argument("--hf-config", default=None,
                   help="--model decoder: a Hugging Face causal-LM config (config.json, its directory or a cached "
                        "name) whose decoder layers become reversible; default: a Llama sized by the command line")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="--model decoder without --hf-config: key/value heads (default: half of --heads)")
    p.add_argument("--export-hf", default=None, help="write the trained model and tokenizer here (save_pretrained)")
    p.add_argument("--sample-tokens", type=int, default=32,
                   help="tokens generated at the end from the first validation tokens (0: none)")
    p.add_argument("--stages", type=int, default=None,
                   help="PETRA stages J (default: fitted to the processes, one per layer when they divide it)")
    p.add_argument("--data-parallel", type=int, default=None,
                   help="pipeline replicas (default: the fewest that fit the processes to the layers)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


@contextmanager
def rank0_first():
    """Rank 0 builds caches (tokenizer, tokenized data) before the others read them."""
    if dist.get_rank() != 0:
        dist.barrier()
    yield
    if dist.get_rank() == 0:
        dist.barrier()


def reformer_model(args, vocab_size: int):
    from transformers import ReformerConfig, ReformerModelWithLMHead

    from petra_ds.models.reformer import chunk_multiple, reformer_layers

    hf = None
    if args.from_pretrained:
        hf = ReformerModelWithLMHead.from_pretrained(args.from_pretrained)
        config = hf.config
    elif args.reformer_config:
        config = ReformerConfig.from_pretrained(args.reformer_config)
    else:  # a small local-attention Reformer sized by the command line
        chunk = min(64, args.seq_len)
        config = ReformerConfig(
            vocab_size=vocab_size, hidden_size=args.d_model, num_attention_heads=args.heads,
            attention_head_size=args.d_model // args.heads, attn_layers=["local"] * args.layers,
            feed_forward_size=4 * args.d_model, axial_pos_embds=False, max_position_embeddings=args.seq_len,
            is_decoder=True, local_attn_chunk_length=chunk, local_num_chunks_before=1, local_num_chunks_after=0,
            hidden_dropout_prob=args.dropout, local_attention_probs_dropout_prob=args.dropout, chunk_size_lm_head=0)
    if config.vocab_size < vocab_size:
        raise SystemExit(f"the Reformer's vocab_size {config.vocab_size} is smaller than the tokenizer's {vocab_size}")
    if args.seq_len % chunk_multiple(config):
        raise SystemExit(f"--seq-len {args.seq_len} must be a multiple of the chunk length {chunk_multiple(config)}")
    return config, reformer_layers(config, hf)


def decoder_model(args, vocab_size: int):
    """``--model decoder``: its layer specs and the reversible decoder's own Hugging Face config."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from petra_ds.models.causal_lm import DecoderLMConfig
    from petra_ds.models.decoder import decoder_layers

    plain = None
    if args.from_pretrained:
        plain = AutoModelForCausalLM.from_pretrained(args.from_pretrained)
        config = plain.config
    elif args.hf_config:
        config = AutoConfig.from_pretrained(args.hf_config)
    else:  # SwiGLU's 3 matrices hold what a 4x GELU MLP's 2 do at about 8/3 d
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=args.d_model, num_hidden_layers=args.layers,
                             num_attention_heads=args.heads, num_key_value_heads=args.kv_heads or max(1, args.heads // 2),
                             intermediate_size=64 * math.ceil(8 * args.d_model / 3 / 64),
                             max_position_embeddings=args.seq_len, attention_dropout=args.dropout,
                             tie_word_embeddings=args.tie_embeddings)
    if config.vocab_size < vocab_size:
        raise SystemExit(f"the decoder's vocab_size {config.vocab_size} is smaller than the tokenizer's {vocab_size}: "
                         "raise it in the config or lower --vocab-size")
    return decoder_layers(config, plain, args.grain), DecoderLMConfig.of(config, grain=args.grain)


#: 1F1B only: DeepSpeed's per-forward dropout reseeding base (see build_model)
ONE_F_ONE_B_DROPOUT_BASE = 1_000_003


def build_layers(args, vocab_size: int) -> tuple[list, object]:
    """The layer specs and the Hugging Face config of the model that holds them for generation."""
    if args.model == "reformer":
        hf_config, layers = reformer_model(args, vocab_size)
        return layers, hf_config
    if args.model == "decoder":
        return decoder_model(args, vocab_size)
    from petra_ds.models.causal_lm import RevGPTLMConfig

    hf_config = RevGPTLMConfig.of(RevGPTConfig(
        vocab_size=vocab_size, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
        dropout=args.dropout, tie_embeddings=args.tie_embeddings, grain=args.grain))
    return hf_config.layer_specs(), hf_config


def build_model(args, config: dict, layers: list, layout, method: str, costs=None):
    """The pipeline module cut by ``method``: "uniform" (contiguous layers, one or two a stage when J is
    fitted to the processes, none empty) or "profile" (``costs``: the layer costs)."""
    topology = layout.topology()
    if "petra" not in config:
        module = baseline_module(layers, topology=topology, loss_fn=lm_loss, partition_method=method,
                                 layer_costs=costs, seed_layers=True, base_seed=args.seed)  # PETRA's initial weights
        # DeepSpeed reseeds each layer's forward with base_seed * forward counter + layer index: with base 0
        # every micro-batch would draw the same dropout masks; a base above the layer count keeps them apart
        module.base_seed = ONE_F_ONE_B_DROPOUT_BASE + args.seed
        return module
    config["petra"]["stages_per_rank"] = layout.stages_per_rank
    input_buffer = petra_ds.PetraConfig.from_dict(config["petra"]).input_buffer  # a stage's cost depends on it
    return petra_ds.PetraPipelineModule(layers, topology=topology, loss_fn=lm_loss,
                                        stages_per_rank=layout.stages_per_rank, partition_method=method,
                                        layer_costs=costs, input_buffer=input_buffer, base_seed=args.seed)


def validation_batches(args, micro: int) -> int:
    """Held-out micro-batches per evaluation: ``--eval-batches``, or ``--eval-sequences`` cut into micro-batches."""
    if args.eval_batches is not None:
        return args.eval_batches
    if args.eval_sequences is None:
        return max(1, EVAL_SEQUENCES // micro)
    if args.eval_sequences < micro or args.eval_sequences % micro:
        raise SystemExit(f"--eval-sequences {args.eval_sequences} is not a multiple of the micro-batch size {micro}: "
                         f"give a multiple of {micro} (or --eval-batches N for N micro-batches)")
    return args.eval_sequences // micro


def evaluate(engine, loader, batches: int) -> float:
    return float(engine.eval_batch(iter(loader), num_micro_batches=batches))


def gathered_model(engine, hf_config, args):
    """Rank 0: the trained pipeline as one Hugging Face model, from a checkpoint's per-layer files; else None."""
    save_dir = os.path.join(args.output_dir, "checkpoint")
    engine.save_checkpoint(save_dir, tag="final")
    path = os.path.join(save_dir, "final")
    model = None
    if dist.get_rank() == 0:
        if args.model == "reformer":
            from petra_ds.models.reformer import load_layer_files, to_reformer

            model = to_reformer(hf_config, load_layer_files(hf_config, path))
        else:
            from petra_ds.models.causal_lm import causal_lm

            model = causal_lm(hf_config, path)
    dist.barrier()
    return model.eval() if model is not None else None


def sample(model, tokenizer, val_blocks, args) -> dict:
    """Greedy continuation of the first validation tokens, within the training context."""
    prompt = torch.as_tensor(val_blocks[0]["block"][: max(1, min(16, args.seq_len // 2))]).view(1, -1)
    new = min(args.sample_tokens, args.seq_len - prompt.shape[1])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # one unpadded prompt: a mask of ones, else generate() would mask every prompt token that equals the pad id
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=pad)
    ids = out[0, prompt.shape[1]:].tolist()
    return {"prompt_ids": prompt[0].tolist(), "prompt": tokenizer.decode(prompt[0]), "ids": ids,
            "text": tokenizer.decode(ids)}


def main() -> None:
    args = parse_args()
    petra_ds.init_distributed()
    torch.manual_seed(args.seed)
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    method = apply_run_arguments(args, config)
    if args.optimizer:
        config["optimizer"] = json.loads(args.optimizer)
    if args.from_pretrained and args.tokenizer in ("bpe", "bytes"):
        raise SystemExit(f"--from-pretrained {args.from_pretrained} needs the tokenizer its embeddings were trained "
                         f"with: add --tokenizer {args.from_pretrained} (a fresh --tokenizer {args.tokenizer} would "
                         "give other token ids)")
    if args.from_pretrained and args.model == "revgpt":
        raise SystemExit("--from-pretrained loads a Hugging Face model: use it with --model reformer or --model decoder")
    if args.grain != "block" and args.model == "reformer":
        raise SystemExit(f"--grain {args.grain} splits RevGPT's and the decoder's blocks: use it with --model revgpt "
                         "or --model decoder (a Reformer block stays whole)")
    if args.hf_config and args.model != "decoder":
        raise SystemExit("--hf-config is the decoder's config: add --model decoder (or use --reformer-config for "
                         "--model reformer)")
    os.makedirs(args.output_dir, exist_ok=True)

    with rank0_first():
        raw = load_text(args.data_files, args.dataset, args.dataset_config, args.text_column, seed=args.seed)
        tok_dir = os.path.join(args.output_dir, f"tokenizer-{args.tokenizer}-{args.vocab_size}")
        if args.tokenizer in ("bpe", "bytes") and os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
            tokenizer = build_tokenizer(tok_dir)
        else:
            tokenizer = build_tokenizer(args.tokenizer, raw["train"], args.vocab_size)
            if dist.get_rank() == 0:
                tokenizer.save_pretrained(tok_dir)
        train_blocks = pack(raw["train"], tokenizer, args.seq_len)
        val_blocks = pack(raw["validation"], tokenizer, args.seq_len)
    vocab_size = len(tokenizer)

    layers, hf_config = build_layers(args, vocab_size)
    layout = run_layout(len(layers), args.stages, args.data_parallel, petra="petra" in config, name=args.model)
    apply_global_batch(args, config, layout, split_for_depth=method == "petra")
    replicas = layout.data_parallel
    micro, k = config["train_micro_batch_size_per_gpu"], config.get("gradient_accumulation_steps", 1)
    eval_batches = validation_batches(args, micro)  # a bad --eval-sequences stops the run before it trains
    costs, costs_file = None, None
    if args.partition == "profile":  # the first training micro-batch of the stream
        costs, costs_file = shared_layer_costs(
            layers, lambda: next(iter(lm_stream(train_blocks, micro, seed=args.seed))), lm_loss, args.output_dir,
            reuse=args.layer_costs, keep_existing=args.resume)
    cut = "profile" if args.partition == "profile" else "uniform"
    model = build_model(args, config, layers, layout, cut, costs)
    partition = agreed_partition(model, cut, costs_file)
    if "optimizer" not in config:
        # torch's fused AdamW, on a GPU and on CPU: no JIT build (DeepSpeed's FusedAdam needs nvcc and a minute),
        # and a step that skips a non-finite gradient on the device, without a host read
        config["optimizer"] = {"type": "AdamW", "params": {"betas": [0.9, 0.95], "weight_decay": 0.01,
                                                           "torch_adam": True, "fused": True}}
    params = config["optimizer"].setdefault("params", {})
    params.setdefault("lr", args.lr)  # a config's own lr wins over --lr
    if uses_muon(config):
        params.setdefault("muon_lr", MUON_LR_RATIO * params["lr"])
        params.setdefault("torch_adam", True)  # the other parameters' AdamW: DeepSpeed's FusedAdam is a JIT build
        if not torch.cuda.is_available():
            torch._dynamo.config.disable = True
            if dist.get_rank() == 0:
                print("Muon's orthogonalization runs eagerly on CPU (DeepSpeed would torch.compile it: about 40 s "
                      "per weight shape, and a C++ compiler)", flush=True)
    config.setdefault("scheduler", {"type": "WarmupCosineLR", "params": {
        "total_num_steps": args.max_steps, "warmup_num_steps": min(args.warmup_steps, args.max_steps // 2)}})
    engine, _, _, _ = petra_ds.initialize(args=args, model=model, config=config)

    state = resume(engine, args.output_dir, fall_back=args.resume == "auto") if args.resume else None
    done = engine.global_steps  # train_batch calls behind us: k micro-batches each, in both engines
    shard = (engine.grid.data_parallel_id, replicas)
    data = iter(lm_stream(train_blocks, micro, seed=args.seed, start=done * k, shard=shard))
    val_loader = lm_loader(val_blocks, micro, train=False)
    eval_batches = min(eval_batches, len(val_loader))
    rank0 = dist.get_rank() == 0
    files = RunFiles(args.output_dir, enabled=rank0, resumed_at=done if state else None)
    if rank0:
        print(json.dumps({"train_blocks": len(train_blocks), "val_blocks": len(val_blocks), "vocab": vocab_size,
                          "params": sum(p.numel() for p in model.parameters()), "method": method}))
    metrics, losses = list(files.kept_rows), (state or {}).get("losses", [])
    trained_s = (state or {}).get("elapsed_s", 0.0)
    start, stopped = time.time(), False
    # the steady rate leaves out the first tenth of the steps (compilation, allocator warm-up), evaluations and saves
    warm_step, warm_at, steady, paused = done + max(1, (args.max_steps - done) // 10), None, None, 0.0
    bar = tqdm(total=args.max_steps, initial=done, disable=not rank0, desc=f"{method} {args.model}", dynamic_ncols=True)
    for step in range(done + 1, args.max_steps + 1):
        loss = float(engine.train_batch(data))
        files.gradient_quality(engine)
        if not math.isnan(loss):
            losses.append((step, loss))
            bar.set_postfix(loss=f"{loss:.3f}")
        bar.update()
        last = step == args.max_steps
        if step == warm_step:
            warm_at = time.time()
        elif last and warm_at is not None:
            steady = (step - warm_step) * micro * k * replicas * args.seq_len / (time.time() - warm_at - paused)
        pause_from = time.time()
        if step % args.eval_every == 0 or last:
            if last and method == "petra":
                engine.drain()
                files.gradient_quality(engine)
            val_loss = evaluate(engine, val_loader, eval_batches)
            elapsed = trained_s + time.time() - start
            row = {"step": step, "train_loss": losses[-1][1] if losses else None, "val_loss": val_loss,
                   "val_sequences": eval_batches * micro,
                   "val_perplexity": math.exp(min(val_loss, 50.0)), "elapsed_s": elapsed,
                   "tokens_per_s": step * micro * k * replicas * args.seq_len / elapsed}
            metrics.append(row)
            files.log(row, engine, [("Eval/loss", val_loss, step)], bar.write)
        if args.save_every and step % args.save_every == 0:
            save(engine, args.output_dir, {"losses": losses, "elapsed_s": trained_s + time.time() - start},
                 keep_last=args.keep_last)
        if warm_at is not None:
            paused += time.time() - pause_from
        if step == args.stop_after and not last:
            stopped = True
            break
    bar.close()
    finish_checkpoints(engine)
    if stopped:
        if rank0:
            print(f"stopped after step {args.stop_after} of {args.max_steps}; continue with --resume")
        return
    memory = engine.memory_report() if method == "petra" else None
    skipped = skipped_steps(engine)  # a collective under PETRA
    generated = None
    if args.sample_tokens > 0 or args.export_hf:
        gathered = gathered_model(engine, hf_config, args)
        if rank0 and args.sample_tokens > 0:
            generated = sample(gathered, tokenizer, val_blocks, args)
            print(f"sample: {generated['prompt']!r} -> {generated['text']!r}", flush=True)
        if rank0 and args.export_hf:
            gathered.save_pretrained(args.export_hf)
            tokenizer.save_pretrained(args.export_hf)
            print(f"{type(gathered).__name__} written to {args.export_hf}")
    if rank0:
        summary = {"method": method, "model": args.model, "final_val_loss": metrics[-1]["val_loss"],
                   "final_val_perplexity": metrics[-1]["val_perplexity"], "tokens_per_s": metrics[-1]["tokens_per_s"],
                   "steady_tokens_per_s": steady,
                   "steps": args.max_steps, "world_size": dist.get_world_size(),
                   "stages": getattr(engine, "num_petra_stages", engine.num_stages), "layout": vars(layout),
                   "partition": partition, "settings": engine.run_settings, "memory_rank0": memory,
                   "sample": generated, "args": vars(args), "config": config, **skipped}
        if args.baseline:
            summary["against_baseline"] = against_baseline(summary, args.baseline, "final_val_loss")
            print(summary["against_baseline"]["label"], flush=True)
        files.summary(summary)
        files.gradient_quality_plot(f"{method} {args.model}: gradient quality per stage")
        files.curves(losses, metrics, eval_key="val_loss", eval_label="validation", loss_label="loss (nats/token)",
                     right=("step", "val_perplexity", "train_batch calls", "validation perplexity"), right_log=True)
        print(json.dumps({k: summary[k] for k in ("method", "model", "final_val_loss", "final_val_perplexity")}))


if __name__ == "__main__":
    run_main(main)

"""RevGPT, the reversible decoder and the Reformer adapter: blocks invert with dropout, the engine's gradients equal autograd's,
Hugging Face parity and weight round-trip, bf16 with fp32 streams."""

import functools
import json

import pytest
import torch
from transformers import ReformerConfig, ReformerModelWithLMHead

from petra_ds.models.reformer import ReformerBlock, layer_states, reformer_layers, reformer_state_dict, to_reformer
from petra_ds.models.transformer import AttentionHalf, MLPHalf, RevGPTBlock, RevGPTConfig, lm_loss, revgpt_layers
from petra_ds.nn import ReversibleSequential, micro_batch_rng, reconstruction_error
from petra_ds.models.decoder import DecoderAttentionHalf, DecoderBlock
from petra_ds.tools.toy import decoder_tiny_config, revgpt_tiny_config, token_data

import oracle
from harness import launch, merged_grads


def reformer_config(attn: str, dropout: float = 0.0, hash_seed=None) -> ReformerConfig:
    layers = {"local": ["local", "local"], "lsh": ["lsh", "lsh"], "mixed": ["local", "lsh"]}[attn]
    return ReformerConfig(
        vocab_size=40, hidden_size=16, num_attention_heads=2, attention_head_size=8, attn_layers=layers,
        feed_forward_size=32, axial_pos_embds=False, max_position_embeddings=32, is_decoder=True,
        local_attn_chunk_length=4, lsh_attn_chunk_length=4, local_num_chunks_before=1, local_num_chunks_after=0,
        lsh_num_chunks_before=1, lsh_num_chunks_after=0, num_buckets=4, num_hashes=2, hash_seed=hash_seed,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        lsh_attention_probs_dropout_prob=dropout, local_attention_probs_dropout_prob=dropout,
        pad_token_id=0, chunk_size_lm_head=0)


BLOCKS = {
    "revgpt": lambda: RevGPTBlock(16, 2, 2, dropout=0.2),
    # the block's two halves, each a reversible layer of its own (grain="half")
    "revgpt-attention-half": lambda: AttentionHalf(16, 2, dropout=0.2),
    "revgpt-mlp-half": lambda: MLPHalf(16, 2, dropout=0.2),
    # Hugging Face's own attention (grouped-query, rotary, SDPA with attention dropout) and SwiGLU MLP
    "llama": lambda: DecoderBlock(decoder_tiny_config("llama", hidden=16, dropout=0.2), 0),
    "qwen2": lambda: DecoderBlock(decoder_tiny_config("qwen2", hidden=16, dropout=0.2), 0),
    "mistral": lambda: DecoderBlock(decoder_tiny_config("mistral", hidden=16, dropout=0.2), 0),
    # (the decoder's MLP half is HalfCoupling(G, 2) as RevGPT's; Llama's MLP has no dropout for the control below)
    "llama-attention-half": lambda: DecoderAttentionHalf(decoder_tiny_config("llama", hidden=16, dropout=0.2), 0),
    "reformer-local": lambda: ReformerBlock(reformer_config("local", 0.2), 0),
    "reformer-lsh": lambda: ReformerBlock(reformer_config("lsh", 0.2), 0),  # random rotations too
}


def _block_and_input(name):
    torch.manual_seed(0)
    block = BLOCKS[name]().double().train()
    x = (torch.randn(2, 8, 16, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64))
    return block, x


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_inverts_in_float64_with_dropout_active(name):
    block, x = _block_and_input(name)
    with torch.no_grad(), micro_batch_rng(0, 3, 1):
        y = block(x)
    with torch.no_grad(), micro_batch_rng(0, 4, 1):  # another micro-batch goes through in between
        block(x)
    assert reconstruction_error(x, y) > 1e-2, "the block must transform its input"
    with torch.no_grad(), micro_batch_rng(0, 3, 1):
        x_inv = block.inverse(y)
    with micro_batch_rng(0, 3, 1):
        x_rec, _tape = block.reconstruct(y)
    assert reconstruction_error(x, x_inv) < 1e-10
    assert reconstruction_error(x, x_rec) < 1e-10
    # the control: drawing the masks from the global stream (no key) does not invert
    with torch.no_grad():
        assert reconstruction_error(x, block.inverse(y)) > 1e-3


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_reconstruction_gradients_equal_autograd(name):
    block, x = _block_and_input(name)
    w = tuple(torch.randn_like(t) for t in x)
    leaves = tuple(t.clone().requires_grad_() for t in x)
    with micro_batch_rng(0, 5, 2):
        y = block(leaves)
    sum((a * b).sum() for a, b in zip(y, w)).backward()
    ref_dx = [t.grad for t in leaves]
    ref = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    block.zero_grad(set_to_none=True)
    with micro_batch_rng(0, 5, 2):
        _x, tape = block.reconstruct(tuple(t.detach() for t in y))
    dx = tape.backward(w)
    assert max((a - b).abs().max().item() for a, b in zip(dx, ref_dx)) < 1e-10
    got = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys() and ref
    assert max((got[n] - ref[n]).abs().max().item() for n in ref) < 1e-10


@functools.lru_cache(maxsize=None)
def _run(spec_json):
    return launch(json.loads(spec_json))


def test_lr0_four_stage_revgpt_gradients_equal_autograd():
    """J = 4 on 4 processes: embedding+block, 2 reconstructing blocks, block+norm (FIFO), head."""
    k, batches = 2, 3
    spec = {"model": "revgpt", "pipe": 4, "stages_per_rank": 1, "k": k, "train_batches": batches, "dropout": 0.1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    results = _run(json.dumps(spec, sort_keys=True))
    reconstructs = {j: r for res in results for j, r in res["reconstructs"].items()}
    assert reconstructs == {0: False, 1: True, 2: False, 3: False}
    assert_four_stages_equal_autograd(results, revgpt_layers(revgpt_tiny_config(0.1)), k, batches)


def assert_four_stages_equal_autograd(results, specs, k, batches):
    """Every one of the 4 stages' gradients at every step equals autograd's on the same layers and data."""
    grads = merged_grads(results)
    stages = oracle.build_stages(4, dropout=0.1, specs=specs)
    data = token_data(k * batches, 4)
    for step in range(batches):
        ref = oracle.autograd_group_grads(stages, data, range(step * k, (step + 1) * k), 0, loss=lm_loss)
        for j in range(4):
            assert oracle_max_diff(grads[j][step], ref[j]) < 1e-10, (step, j)


def test_half_grain_computes_the_block_grain_at_the_same_weights():
    """An attention half then an MLP half is the block: same weights (renamed), same loss and gradients in float64."""
    torch.manual_seed(0)
    config = revgpt_tiny_config(0.0)
    blocks = [spec.build().double() for spec in revgpt_layers(config)]
    halves = [spec.build().double() for spec in revgpt_layers(revgpt_tiny_config(0.0, grain="half"))]
    assert len(halves) == len(blocks) + config.n_layers
    assert [type(m).__name__ for m in halves[1:5]] == ["AttentionHalf", "MLPHalf", "AttentionHalf", "MLPHalf"]
    pairs = [(blocks[0], [halves[0]]), (blocks[-2], [halves[-2]]), (blocks[-1], [halves[-1]])]
    pairs += [(blocks[1 + i], halves[1 + 2 * i:3 + 2 * i]) for i in range(config.n_layers)]
    for block, parts in pairs:  # a half's F is the block's F (attention) or G (MLP)
        source = dict(block.named_parameters())
        for part, branch in zip(parts, "FG"):
            for name, p in part.named_parameters():
                p.data.copy_(source[name if len(parts) == 1 else branch + name[1:]])
    ids, labels = token_data(1, 3)[0]

    def loss_and_grads(modules):
        x = ids
        for m in modules:
            x = m(x)
        loss = lm_loss(x, labels)
        loss.backward()
        return loss, torch.cat([p.grad.flatten() for m in modules for p in m.parameters()])

    loss_b, grad_b = loss_and_grads(blocks)
    loss_h, grad_h = loss_and_grads(halves)
    assert abs(loss_b.item() - loss_h.item()) < 1e-12 and grad_b.abs().max() > 0
    assert (grad_b - grad_h).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="grain 'quarter'"):
        RevGPTConfig(vocab_size=8, seq_len=4, grain="quarter")


def test_lr0_revgpt_cut_between_a_blocks_halves_equals_autograd():
    """grain="half", J = 4 on 2 processes: the uniform cut of 11 layers falls between a block's attention and MLP
    halves, and every stage's gradients equal autograd's."""
    k, batches = 2, 2
    spec = {"model": "revgpt", "grain": "half", "pipe": 2, "stages_per_rank": 2, "k": k, "train_batches": batches,
            "dropout": 0.1, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    results = _run(json.dumps(spec, sort_keys=True))
    specs = revgpt_layers(revgpt_tiny_config(0.1, grain="half"))
    parts = results[0]["parts"]
    names = [spec.typename.__name__ for spec in specs]
    assert any(names[b - 1] == "AttentionHalf" and names[b] == "MLPHalf" for b in parts[1:-1]), (parts, names)
    reconstructs = {j: r for res in results for j, r in res["reconstructs"].items()}
    assert reconstructs[1] and reconstructs[2]
    assert_four_stages_equal_autograd(results, specs, k, batches)


def oracle_max_diff(a, b):
    assert a.keys() == b.keys() and a
    return max((a[n] - b[n]).abs().max().item() for n in a)


# --- Hugging Face Reformer ---

def _logits(modules, ids):
    x = ids
    for m in modules:
        x = m(x)
    return x


@pytest.mark.parametrize("attn", ["local", "lsh", "mixed"])
def test_reformer_adapter_logits_match_hugging_face(attn):
    torch.manual_seed(0)
    config = reformer_config(attn, dropout=0.1, hash_seed=7)  # LSH in eval hashes with the config's seed
    hf = ReformerModelWithLMHead(config).eval()
    modules = [spec.build().eval() for spec in reformer_layers(config, hf)]
    ids = torch.randint(0, config.vocab_size, (3, 16))
    with torch.no_grad():
        ref = hf(ids).logits
        got = _logits(modules, ids)
    assert ref.abs().max() > 0.1
    assert (got - ref).abs().max().item() < 1e-5
    # a config alone gives a fresh model of the same shape
    fresh = [spec.build() for spec in reformer_layers(config)]
    assert [sum(p.numel() for p in m.parameters()) for m in fresh] == \
        [sum(p.numel() for p in m.parameters()) for m in modules]


def test_reformer_weights_round_trip_through_save_pretrained(tmp_path):
    torch.manual_seed(1)
    config = reformer_config("mixed", hash_seed=3)
    modules = [spec.build() for spec in reformer_layers(config)]
    with torch.no_grad():  # "trained" weights: not the initialisation
        for p in (p for m in modules for p in m.parameters()):
            p.add_(0.01 * torch.randn_like(p))
    model = to_reformer(config, layer_states(modules))
    model.save_pretrained(tmp_path)
    loaded = ReformerModelWithLMHead.from_pretrained(tmp_path).eval()
    state = reformer_state_dict(config, layer_states(modules))
    assert state.keys() == loaded.state_dict().keys()
    assert all(torch.equal(state[n], t) for n, t in loaded.state_dict().items())
    ids = torch.randint(0, config.vocab_size, (2, 8))
    for m in modules:
        m.eval()
    with torch.no_grad():
        assert (loaded(ids).logits - _logits(modules, ids)).abs().max().item() < 1e-5


def test_reformer_refuses_a_non_causal_config():
    config = reformer_config("local")
    config.is_decoder = False
    with pytest.raises(ValueError, match="is_decoder=True"):
        reformer_layers(config)
    config = reformer_config("local")
    config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        reformer_layers(config)


def test_reformer_sequence_length_must_be_a_chunk_multiple():
    modules = [spec.build() for spec in reformer_layers(reformer_config("local"))]
    with pytest.raises(ValueError, match="multiple of the Reformer chunk length 4"):
        _logits(modules, torch.zeros(1, 6, dtype=torch.long))


# --- bf16: fp32 residual streams ---

BF16_BOUND = {1.0: 1e-5, 5.0: 5e-3}  # weight scale -> max |x~ - x| / max |x| after 12 blocks


@pytest.mark.parametrize("scale", sorted(BF16_BOUND))
def test_bf16_with_fp32_streams_reconstructs_through_12_blocks(scale):
    """F and G in bf16, streams in fp32: the reconstruction error stays within the stated bound; the
    same chain with bf16 streams is at least 5x worse."""
    torch.manual_seed(0)
    chain = ReversibleSequential(*[RevGPTBlock(64, 4, 4, dropout=0.1, n_layers=12) for _ in range(12)]).train()
    with torch.no_grad():
        for p in chain.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    x = torch.randn(4, 32, 64)
    errors = {}
    for stream in (torch.float32, torch.bfloat16):
        xs = (x.to(stream), x.to(stream))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), micro_batch_rng(0, 0, 1):
            y = chain(xs)
            x_rec = chain.inverse(y)
        assert y[0].dtype == stream
        errors[stream] = reconstruction_error(x, tuple(t.float() for t in x_rec)) / x.abs().max().item()
        if stream == torch.float32:  # the engine's path (graph built while inverting) gives the same x~
            with torch.autocast("cpu", dtype=torch.bfloat16), micro_batch_rng(0, 0, 1):
                x_graph, _ = chain.reconstruct(y)
            assert reconstruction_error(x_rec, x_graph) == 0
    assert errors[torch.float32] < BF16_BOUND[scale], errors
    assert errors[torch.bfloat16] > 5 * errors[torch.float32], errors


def test_revgpt_config_errors_and_tied_specs():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        RevGPTConfig(vocab_size=10, seq_len=4, d_model=10, n_heads=3)
    specs = revgpt_layers(RevGPTConfig(vocab_size=10, seq_len=4, d_model=8, n_layers=2, n_heads=2, tie_embeddings=True))
    assert type(specs[0]).__name__ == "TiedLayerSpec" and type(specs[-1]).__name__ == "TiedLayerSpec"
    embedding = specs[0].build()
    with pytest.raises(ValueError, match="built for seq_len 4"):
        embedding(torch.zeros(1, 5, dtype=torch.long))


# --- tied input/output embeddings across stages ---

TIED = "6.token.weight"  # the head's copy; layer 0 (the embedding, stage 0) owns the weights


def test_tied_embeddings_lr0_owner_steps_with_the_whole_gradient():
    """The owner's gradient of the tied weights is autograd's (both uses, same k micro-batches); the
    other stages' too; the head's copy (on the other rank) holds the owner's weights."""
    k, batches = 2, 3
    spec = {"model": "revgpt", "tie_embeddings": True, "pipe": 2, "stages_per_rank": 2, "k": k,
            "train_batches": batches, "dropout": 0.1, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    results = _run(json.dumps(spec, sort_keys=True))
    grads = merged_grads(results)
    stages = oracle.build_stages(4, dropout=0.1, specs=revgpt_layers(revgpt_tiny_config(0.1, tie_embeddings=True)))
    data = token_data(k * batches, 4)
    for step in range(batches):
        ref = oracle.autograd_group_grads(stages, data, range(step * k, (step + 1) * k), 0, loss=lm_loss)
        for name in (TIED, "6.position.weight"):  # the head's copy of the embedding module: its share of
            ref[3].pop(name)                      # the tied gradient goes to the owner (checked there),
            grads[3][step].pop(name)              # the position table is not used by the head
        assert grads[3][step] == ref[3] == {}  # the head stage holds nothing else
        for j in range(3):
            assert oracle_max_diff(grads[j][step], ref[j]) < 1e-10, (step, j)
    params = {n: v for r in results for n, v in r["params"].items()}
    assert torch.equal(params["0.token.weight"], params[TIED])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(1, 4), (2, 2)])
def test_tied_embeddings_train_the_same_in_every_layout(layout):
    """lr > 0, momentum: 4 x 1, 2 x 2 and 1 x 4 give identical parameters (the head's copy included),
    and the tie holds after the drain."""
    def params(pipe, spr):
        spec = {"model": "revgpt", "tie_embeddings": True, "pipe": pipe, "stages_per_rank": spr, "k": 2,
                "train_batches": 4, "dropout": 0.1, "capture_grads": False}
        results = _run(json.dumps(spec, sort_keys=True))
        out = {}
        for r in results:
            out.update(r["params"])
        # DeepSpeed synchronises only ``tied_weight_attr``; the rest of a reader's module (an unused
        # position table here) is initialised with the seed of the rank's first use of the module
        out.pop("6.position.weight")
        return out

    ref, got = params(4, 1), params(*layout)
    assert ref.keys() == got.keys()
    assert max((ref[n] - got[n]).abs().max().item() for n in ref) < 1e-12
    assert torch.equal(got["0.token.weight"], got[TIED])
    assert (got["0.token.weight"] - oracle.build_stages(4, 0.1, specs=revgpt_layers(
        revgpt_tiny_config(0.1, tie_embeddings=True)))[0][0][1].token.weight).abs().max() > 1e-4


@pytest.mark.slow
def test_tied_embeddings_exact_resume(tmp_path):
    """Save mid-flight with the head on another rank, resume in fresh processes: same parameters, the
    head's copy included (DeepSpeed's layer files do not hold it; the PETRA state does)."""
    common = {"model": "revgpt", "tie_embeddings": True, "pipe": 2, "stages_per_rank": 2, "k": 2,
              "train_batches": 5, "dropout": 0.1, "capture_grads": False,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
    whole = {n: v for r in launch(common) for n, v in r["params"].items()}
    ckpt = str(tmp_path / "ckpt")
    launch({**common, "save_dir": ckpt, "save_after": 2, "save_tag": "mid"})
    resumed = {n: v for r in launch({**common, "load_dir": ckpt}) for n, v in r["params"].items()}
    assert whole.keys() == resumed.keys()
    assert max((whole[n] - resumed[n]).abs().max().item() for n in whole) == 0.0
    assert torch.equal(resumed["0.token.weight"], resumed[TIED])

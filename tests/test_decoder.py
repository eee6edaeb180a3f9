"""The reversible decoder from Hugging Face's own Llama / Qwen2 / Mistral modules, and generation.

F and G equal Hugging Face's modules called directly (with an explicit causal mask, where our F lets SDPA's
``is_causal`` mask); a plain checkpoint maps tensor for tensor; PETRA's gradients at lr 0 equal
autograd's through the engine at J = 4; generation with a cache equals generation without, token for token,
for RevGPT, the decoder and the Reformer; ``from_pretrained`` gives back the same greedy text."""

import functools
import json
import logging
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, ReformerModelWithLMHead

from petra_ds.models import causal_lm
from petra_ds.models.causal_lm import DecoderForCausalLM, DecoderLMConfig, RevGPTForCausalLM, RevGPTLMConfig
from petra_ds.models.decoder import DecoderBlock, decoder_layers, plain_prefixes, split_plain_state
from petra_ds.tools.toy import VOCAB, decoder_tiny_config

from harness import launch
from test_transformer import assert_four_stages_equal_autograd, reformer_config

TYPES = ["llama", "qwen2", "mistral"]


def _plain(config):
    """A plain Hugging Face causal LM of ``config``, in float64 (eager attention would softmax in float32)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double().eval()


@pytest.mark.parametrize("model_type", TYPES)
def test_f_and_g_equal_hugging_face_modules_called_directly(model_type):
    config = decoder_tiny_config(model_type, hidden=16, layers=1)
    plain = _plain(config)
    layer = plain.model.layers[0]
    block = decoder_layers(config, plain)[1].build().double().eval()
    x, y1 = torch.randn(2, 9, 16, dtype=torch.float64), torch.randn(2, 9, 16, dtype=torch.float64)
    positions = torch.arange(9).unsqueeze(0)
    causal = torch.full((9, 9), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        ref_f = layer.self_attn(layer.input_layernorm(x), position_embeddings=plain.model.rotary_emb(x, positions),
                                attention_mask=causal)[0]
        ref_g = layer.mlp(layer.post_attention_layernorm(y1))
        assert (block.F(x) - ref_f).abs().max().item() < 1e-12 and ref_f.abs().max() > 1e-5
        assert (block.G(y1) - ref_g).abs().max().item() < 1e-12 and ref_g.abs().max() > 1e-5
        # the causal mask matters: a future token changes nothing before it
        x2 = x.clone()
        x2[:, -1] += 1.0
        assert torch.equal(block.F(x2)[:, :-1], block.F(x)[:, :-1])
    # grouped-query attention: 2 query heads share 1 key/value head
    attn = block.F.self_attn
    assert attn.k_proj.out_features == attn.q_proj.out_features // 2 and attn.num_key_value_groups == 2
    assert config._attn_implementation == "sdpa"


@pytest.mark.parametrize("tie", [False, True])
def test_a_plain_checkpoint_maps_tensor_for_tensor(tie):
    config = decoder_tiny_config("llama", tie_embeddings=tie)
    plain = _plain(config)
    states = split_plain_state(config, plain.state_dict())
    kept = states[:-1] if tie else states  # a tied head repeats the embedding
    assert sum(t.numel() for s in kept for t in s.values()) == sum(
        t.numel() for n, t in plain.state_dict().items() if not (tie and n == "lm_head.weight"))
    modules = [spec.build().double() for spec in decoder_layers(config, plain)]
    assert torch.equal(modules[0].embed_tokens.weight, plain.model.embed_tokens.weight)
    assert torch.equal(modules[2].G.mlp.down_proj.weight, plain.model.layers[1].mlp.down_proj.weight)
    assert torch.equal(modules[-2].norm.weight, plain.model.norm.weight)
    head = modules[-1].embed_tokens.weight if tie else modules[-1].lm_head.weight
    assert torch.equal(head, plain.lm_head.weight)


@pytest.mark.parametrize("tie", [False, True])
def test_the_half_grain_loads_the_same_plain_tensors_and_computes_the_block_grain(tie):
    """grain="half": each decoder layer is an attention half then an MLP half. From one plain checkpoint both grains
    hold every tensor once, and in float64 they give the same loss and the same gradient for every plain tensor."""
    config = decoder_tiny_config("llama", hidden=16, layers=2, tie_embeddings=tie)
    plain = _plain(config)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    grads, losses = {}, {}
    for grain in ("block", "half"):
        specs = decoder_layers(config, plain, grain)
        modules = [spec.build().double() for spec in specs]
        if grain == "half":
            assert [type(m).__name__ for m in modules[1:5]] == ["DecoderAttentionHalf", "DecoderMLPHalf"] * 2
        x = ids
        for m in modules[:-1]:
            x = m(x)
        logits = modules[0].logits(x) if tie else modules[-1](x)
        losses[grain] = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        losses[grain].backward()
        own_to_plain = [{own: theirs for theirs, own in layer.items()} for layer in plain_prefixes(config, grain)]
        grads[grain] = {}
        for module, names in zip(modules[:-1] if tie else modules, own_to_plain):
            for name, p in module.named_parameters():
                own = next(prefix for prefix in names if name.startswith(prefix))
                grads[grain][names[own] + name[len(own):]] = p.grad
    assert abs(losses["block"].item() - losses["half"].item()) < 1e-12
    assert grads["block"].keys() == grads["half"].keys() == {n for n in plain.state_dict() if "rotary" not in n
                                                              and not (tie and n == "lm_head.weight")}
    assert max((grads["block"][n] - grads["half"][n]).abs().max().item() for n in grads["block"]) < 1e-12
    with pytest.raises(ValueError, match="decoder grain 'quarter'"):
        decoder_layers(config, grain="quarter")


def test_configs_the_decoder_cannot_reproduce_are_refused():
    with pytest.raises(ValueError, match="Llama-, Qwen2-, Qwen3- and Mistral-style"):
        decoder_layers(AutoConfig.for_model("gemma", num_hidden_layers=1))
    with pytest.raises(ValueError, match="full causal attention only"):
        decoder_layers(AutoConfig.for_model("qwen2", num_hidden_layers=2, use_sliding_window=True,
                                            sliding_window=8, max_window_layers=0))
    with pytest.raises(ValueError, match="not a causal-LM config"):
        decoder_layers(AutoConfig.for_model("t5"))
    windowed = decoder_tiny_config("mistral", hidden=16)
    windowed.sliding_window = 4
    block = DecoderBlock(windowed, 0)
    with pytest.raises(ValueError, match="sliding_window 4"):
        block((torch.randn(1, 5, 16), torch.randn(1, 5, 16)))


def test_a_qwen2_window_that_no_layer_uses_limits_no_sequence():
    """use_sliding_window with max_window_layers >= num_hidden_layers: every layer attends fully (Hugging Face's
    layer_types), so a sequence longer than sliding_window runs, and F equals Hugging Face's attention."""
    config = decoder_tiny_config("qwen2", hidden=16, layers=1, use_sliding_window=True, sliding_window=4,
                                 max_window_layers=1)
    assert config.sliding_window == 4 and config.layer_types == ["full_attention"]
    plain = _plain(config)
    layer = plain.model.layers[0]
    assert layer.self_attn.sliding_window is None  # Hugging Face's own reading of the config
    block = decoder_layers(config, plain)[1].build().double().eval()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    causal = torch.full((9, 9), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        ref = layer.self_attn(layer.input_layernorm(x), attention_mask=causal,
                              position_embeddings=plain.model.rotary_emb(x, torch.arange(9).unsqueeze(0)))[0]
        assert (block.F(x) - ref).abs().max().item() < 1e-12


@functools.lru_cache(maxsize=None)
def _run(spec_json):
    return launch(json.loads(spec_json))


def test_lr0_four_stage_decoder_gradients_equal_autograd():
    """J = 4 on 2 processes (2 stages each: placement changes nothing, tests/test_engine.py), attention dropout on:
    PETRA's gradients equal autograd's on the same weights (no clipping: stage 0's norm passes DeepSpeed's
    default 1.0)."""
    k, batches = 2, 3
    spec = {"model": "decoder", "pipe": 2, "stages_per_rank": 2, "k": k, "train_batches": batches, "dropout": 0.1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "config": {"gradient_clipping": 0.0}}
    results = _run(json.dumps(spec, sort_keys=True))
    assert {j: r for res in results for j, r in res["reconstructs"].items()} == {0: False, 1: True, 2: False, 3: False}
    assert_four_stages_equal_autograd(results, decoder_layers(decoder_tiny_config(dropout=0.1)), k, batches)


# --- generation ---

def _models():
    torch.manual_seed(0)
    return {
        "revgpt": RevGPTForCausalLM(RevGPTLMConfig(vocab_size=40, seq_len=32, d_model=16, n_layers=2, n_heads=2)),
        "revgpt-tied": RevGPTForCausalLM(RevGPTLMConfig(vocab_size=40, seq_len=32, d_model=16, n_layers=2, n_heads=2,
                                                        tie_embeddings=True)),
        "revgpt-half": RevGPTForCausalLM(RevGPTLMConfig(vocab_size=40, seq_len=32, d_model=16, n_layers=2, n_heads=2,
                                                        grain="half")),
        "llama": DecoderForCausalLM(DecoderLMConfig.of(decoder_tiny_config("llama", hidden=16, layers=2))),
        "llama-half": DecoderForCausalLM(DecoderLMConfig.of(decoder_tiny_config("llama", hidden=16, layers=2),
                                                            grain="half")),
        "qwen2-tied": DecoderForCausalLM(DecoderLMConfig.of(decoder_tiny_config("qwen2", hidden=16, layers=2,
                                                                                tie_embeddings=True))),
    }


@pytest.mark.parametrize("name", ["revgpt", "revgpt-tied", "revgpt-half", "llama", "llama-half", "qwen2-tied"])
def test_cached_generation_equals_uncached_token_for_token(name):
    model = _models()[name].double().eval()
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    greedy = {c: model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=c) for c in (True, False)}
    assert torch.equal(greedy[True], greedy[False]) and greedy[True].shape == (2, 25)
    sampled = {}
    for cache in (True, False):
        torch.manual_seed(5)
        sampled[cache] = model.generate(prompt, max_new_tokens=20, do_sample=True, top_k=10, use_cache=cache)
    assert torch.equal(sampled[True], sampled[False])
    assert not torch.equal(sampled[True], greedy[True])
    # the cache's logits are the full pass's, position for position
    full = model(greedy[True]).logits
    out = model(greedy[True][:, :12], use_cache=True)
    step = model(greedy[True][:, 12:], past_key_values=out.past_key_values, use_cache=True).logits
    assert (torch.cat([out.logits, step], 1) - full).abs().max().item() < 1e-12


@pytest.mark.parametrize("name", ["qwen2-tied", "revgpt-tied"])
def test_generation_passes_the_cache_by_the_name_the_installed_transformers_takes(name):
    """No deprecation from Hugging Face, as a warning or in its log (transformers 5.24 renamed ``past_key_values``
    to ``cache`` in the attention's arguments and in the model's output; the old names go in 5.40)."""
    from transformers.utils import logging as hf_logging

    model = _models()[name].double().eval()
    prompt = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(1))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_logging.warning_once.cache_clear()  # a message another test logged first would be logged once only
    hf_logging.get_logger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            out = model.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=True)
    finally:
        hf_logging.get_logger("transformers").removeHandler(handler)
    assert out.shape == (1, 7)
    assert not [r.getMessage() for r in records if "deprecated" in r.getMessage()]


def test_reformer_generates_the_same_with_and_without_its_cache():
    torch.manual_seed(0)
    model = ReformerModelWithLMHead(reformer_config("local")).double().eval()
    prompt = torch.randint(1, 40, (1, 4), generator=torch.Generator().manual_seed(1))
    cached, uncached = (model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, use_cache=c,
                                       pad_token_id=0)
                        for c in (True, False))
    assert torch.equal(cached, uncached) and cached.shape == (1, 16)


@pytest.mark.parametrize("name", ["revgpt-tied", "revgpt-half", "llama", "llama-half"])
def test_from_pretrained_gives_the_same_greedy_text(tmp_path, name):
    model = _models()[name].eval()
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    before = model.generate(prompt, max_new_tokens=15, do_sample=False)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=15, do_sample=False), before)


def test_the_gathered_model_is_the_pipeline():
    """from_layer_states puts the pipeline layers' own weights in order: the logits are the layers' in turn."""
    config = decoder_tiny_config("llama", hidden=16, layers=2)
    modules = [spec.build().eval() for spec in decoder_layers(config)]
    model = DecoderForCausalLM.from_layer_states(DecoderLMConfig.of(config), [m.state_dict() for m in modules]).eval()
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        x = ids
        for m in modules:
            x = m(x)
        assert torch.equal(model(ids).logits, x)
        # labels as Hugging Face's causal LMs take them: the inputs, shifted inside
        loss = torch.nn.functional.cross_entropy(x[:, :-1].reshape(-1, x.shape[-1]), ids[:, 1:].reshape(-1))
        assert torch.allclose(model(ids, labels=ids).loss, loss)
        with pytest.raises(ValueError, match="3 layer states for a pipeline of 5 layers"):
            DecoderForCausalLM.from_layer_states(DecoderLMConfig.of(config), [m.state_dict() for m in modules[:3]])
        with pytest.raises(ValueError, match="a padded batch"):
            model(ids, attention_mask=torch.tensor([[0] + [1] * 6, [1] * 7]))
    assert causal_lm.AutoConfig.for_model("petra_reversible_decoder").model_type == "petra_reversible_decoder"


def test_the_oldest_transformers_is_named_once_and_older_ones_are_refused():
    """pyproject.toml's floor is the decoder's :data:`OLDEST_TRANSFORMERS`; an older install is refused with the
    command that fixes it (4.53 computes attention with other masks: the decoder's F would differ silently)."""
    import os
    import re

    from petra_ds.models.decoder import OLDEST_TRANSFORMERS, check_transformers

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    floor = re.search(r'"transformers>=([\d.]+)"', open(os.path.join(root, "pyproject.toml")).read()).group(1)
    assert tuple(int(p) for p in floor.split(".")) == OLDEST_TRANSFORMERS
    with pytest.raises(ImportError, match=r"pip install 'transformers>=4\.54'"):
        check_transformers("4.53.3")
    check_transformers("4.54.0")
    check_transformers("5.24.0")


@pytest.mark.slow
def test_the_decoder_equals_hugging_face_on_the_oldest_transformers_allowed(tmp_path):
    """This file's tests, in a virtualenv over this one with the oldest transformers pyproject.toml allows (the
    default run covers the newest, which CI installs). Needs the package registry, as CI's install does."""
    import os
    import site
    import subprocess
    import venv

    from petra_ds.models.decoder import OLDEST_TRANSFORMERS

    env_dir = tmp_path / "oldest"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = str(env_dir / "bin" / "python")
    # this environment's packages after the new one's own: a virtualenv's system site is the base interpreter's,
    # which a test run from a virtualenv (as the README installs) would otherwise lose
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, timeout=300, check=True).stdout.strip()
    with open(os.path.join(purelib, "this_environment.pth"), "w") as pth:
        pth.write("".join(f"import site; site.addsitedir({path!r})\n" for path in site.getsitepackages()))
    oldest = ".".join(map(str, OLDEST_TRANSFORMERS))
    pin = f"transformers=={oldest}.*"
    installed = subprocess.run([python, "-m", "pip", "install", "-q", pin], capture_output=True, text=True,
                               timeout=900)
    assert installed.returncode == 0, installed.stderr[-3000:]
    version = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, timeout=300).stdout.strip()
    assert version.startswith(oldest + "."), version
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                           "-m", "not slow"], capture_output=True, text=True, cwd=root, timeout=1800)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]

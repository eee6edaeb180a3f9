"""A reversible decoder from a Hugging Face causal-LM config (Llama, Qwen2, Qwen3, Mistral), as DeepSpeed layer specs.

Hugging Face's own decoder layer is built, then split: its pre-norm attention becomes F and its pre-norm
MLP becomes G of an additive coupling, with rotary positions from the model's own rotary module and
attention as Hugging Face configures it (SDPA unless the config says otherwise):

    embedding (non-reversible)   embed_tokens, copied into both streams
    N x DecoderBlock (reversible) y1 = x1 + F(x2), y2 = x2 + G(y1)
                                  F = self_attn(input_layernorm(x2))  (RoPE, causal, grouped-query as configured)
                                  G = mlp(post_attention_layernorm(y1))
                                  (``grain="half"``: each block as two layers, DecoderAttentionHalf
                                  y1 = x1 + F(x2) and DecoderMLPHalf y2 = x2 + G(y1), so a partition may
                                  cut between F and G)
    final norm (non-reversible)  the model's RMSNorm of (y1 + y2) / 2, as RevGPT mixes its streams
    LM head (non-reversible)     lm_head, or the embedding's weight where the config ties them

A plain model's residual stream ``h + attn(h) + mlp(...)`` is one stream, a reversible block's is two: a plain
checkpoint of the same config loads tensor for tensor (:func:`decoder_layers` with ``model``), but it is a
starting point with the same shapes, not the same function. Gemma-style embeddings (scaled by sqrt(d)) and
layers with extra norms are refused: their decoder layer is more than one attention and one MLP.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Sequence

import torch
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec
from torch import Tensor, nn
from torch.nn import functional as F_
import transformers
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..nn.coupling import AdditiveCoupling, HalfCoupling
from ..nn.draws import by_children, hooked_under
from .attention import cached_attention_mask
from .layer_states import State, load_into, split_by_prefix
from .transformer import GRAINS, init_normal, tied_logits

TIE_KEY = "embed_tokens"
#: the oldest transformers whose modules the decoder reproduces exactly (pyproject.toml requires it; older
#: releases call attention with other masks and positions, and the decoder's F would differ from theirs)
OLDEST_TRANSFORMERS = (4, 54)
_LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


def _hf_module(config: PretrainedConfig) -> tuple[Any, type]:
    """The ``modeling_*`` module and the causal-LM class Hugging Face builds for ``config``."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        raise ValueError(f"{type(config).__name__} is not a causal-LM config Hugging Face knows: use a Llama-, "
                         "Qwen2-, Qwen3- or Mistral-style config")
    return sys.modules[model_class.__module__], model_class


def check_transformers(version: str) -> None:
    """Refuse a transformers older than :data:`OLDEST_TRANSFORMERS`, saying what to install."""
    installed = tuple(int(part) for part in version.split(".")[:2])
    if installed < OLDEST_TRANSFORMERS:
        oldest = ".".join(map(str, OLDEST_TRANSFORMERS))
        raise ImportError(f"transformers {version} is installed; the reversible decoder reproduces Hugging Face's "
                          f"modules from transformers {oldest} on: pip install 'transformers>={oldest}'")


def check_config(config: PretrainedConfig) -> None:
    """Refuse what the two-stream decoder cannot reproduce from Hugging Face's modules, saying what to change."""
    check_transformers(transformers.__version__)
    _hf_module(config)
    if "gemma" in config.model_type:
        raise ValueError(f"{config.model_type} scales its embeddings and adds norms around its MLP: the reversible "
                         "decoder builds Llama-, Qwen2-, Qwen3- and Mistral-style layers only")
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention"}:
        raise ValueError(f"layer types {sorted(layer_types)}: the reversible decoder trains full causal attention "
                         "only; set use_sliding_window=False (Qwen2) or layer_types to full_attention")
    if getattr(config, "num_hidden_layers", 0) < 1:
        raise ValueError("the config needs num_hidden_layers >= 1")


def hf_decoder_layer(config: PretrainedConfig, layer_idx: int) -> nn.Module:
    """Hugging Face's own decoder layer ``layer_idx`` for ``config`` (e.g. ``LlamaDecoderLayer``)."""
    module, model_class = _hf_module(config)
    layer = getattr(module, model_class._no_split_modules[0])(config, layer_idx)
    missing = [name for name in _LAYER_PARTS if not isinstance(getattr(layer, name, None), nn.Module)]
    extra = sorted(name for name, _ in layer.named_children() if name not in _LAYER_PARTS)
    if missing or extra:
        raise ValueError(f"{type(layer).__name__} is not one pre-norm attention and one pre-norm MLP (missing "
                         f"{missing}, extra {extra}): its parts cannot stand alone as F and G")
    return layer


def _hf_class(config: PretrainedConfig, suffix: str) -> type:
    """The model's own class named like its decoder layer, e.g. ``LlamaRMSNorm``, ``LlamaRotaryEmbedding``."""
    module, model_class = _hf_module(config)
    prefix = model_class._no_split_modules[0].removesuffix("DecoderLayer")
    return getattr(module, prefix + suffix)


def prepared(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` checked, with SDPA attention where it names none (as ``from_pretrained`` would choose)."""
    check_config(config)
    if config._attn_implementation is None:
        config._attn_implementation = "sdpa"
    return config


def dropout_rate(config: PretrainedConfig) -> float:
    """The largest dropout rate ``config`` sets (``attention_dropout``; ``*dropout*`` or ``*pdrop*`` elsewhere): the
    decoder layers Hugging Face builds from a config draw random numbers through those rates only."""
    rates = [float(value) for name, value in vars(config).items()
             if ("dropout" in name or "pdrop" in name) and type(value) in (int, float)]
    return max(rates, default=0.0)


def _config_draws(part: nn.Module) -> bool:
    """``draws_random`` (``petra_ds.nn.draws``) of F or G, made of a Hugging Face decoder layer's modules: in
    training, when its config sets a dropout rate (``part.config_dropout``) or its attention's rate was raised since;
    and whenever a forward hook on one of its modules can run other code."""
    rate = max(part.config_dropout, float(getattr(getattr(part, "self_attn", None), "attention_dropout", 0.0)))
    return (part.training and rate > 0) or hooked_under(part)


class DecoderEmbedding(nn.Module):
    """``embed_tokens``; both streams start from the same ``h``."""

    draws_random = by_children  # an nn.Embedding (``petra_ds.nn.draws``)

    def __init__(self, config: PretrainedConfig, state: State | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        init_normal(self, config.initializer_range)
        load_into(self, state, "embedding")

    def forward(self, ids: Tensor, start: int = 0) -> tuple[Tensor, Tensor]:
        if ids.dim() != 2:
            raise ValueError(f"the decoder expects token ids of shape (batch, seq), got {tuple(ids.shape)}")
        h = self.embed_tokens(ids)
        return h, h

    def logits(self, h: Tensor) -> Tensor:
        """The tied LM head: ``h @ embed_tokens.weight^T``."""
        return F_.linear(h, self.embed_tokens.weight)


class DecoderAttention(nn.Module):
    """F: Hugging Face's ``self_attn(input_layernorm(x))`` at rotary positions ``start, start + 1, ...``.

    ``cache`` (a Hugging Face ``Cache``) is for generation: the layer appends its keys and values there."""

    draws_random = _config_draws

    def __init__(self, config: PretrainedConfig, layer: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.rotary_emb = _hf_class(config, "RotaryEmbedding")(config)
        self.config_dropout = dropout_rate(config)
        # a config that names its layers' types says which attend through a window (check_config refuses those:
        # Qwen2's sliding_window then applies to none), one that does not (Mistral) windows every layer
        self.window = None if getattr(config, "layer_types", None) else getattr(config, "sliding_window", None)
        # the name Hugging Face's attention takes its cache by: ``cache`` from transformers 5.24 (``past_key_values``
        # warns there, and goes in 5.40), ``past_key_values`` before, ``past_key_value`` in 4.x
        accepted = inspect.signature(self.self_attn.forward).parameters
        self.cache_keyword = next((n for n in ("cache", "past_key_values", "past_key_value") if n in accepted),
                                  "past_key_values")

    def forward(self, x: Tensor, cache: Any = None, start: int = 0, **_: Any) -> Tensor:
        if self.window is not None and start + x.shape[1] > self.window:
            raise ValueError(f"{start + x.shape[1]} positions exceed the config's sliding_window {self.window}: the "
                             "reversible decoder attends to every earlier position; use shorter sequences")
        positions = torch.arange(start, start + x.shape[1], device=x.device).unsqueeze(0)
        h = self.input_layernorm(x)
        cos_sin = self.rotary_emb(h, positions)
        mask = cached_attention_mask(x.shape[1], start + x.shape[1], x.device)
        return self.self_attn(h, position_embeddings=cos_sin, attention_mask=mask, **{self.cache_keyword: cache})[0]


class DecoderMLP(nn.Module):
    """G: Hugging Face's ``mlp(post_attention_layernorm(y1))``."""

    draws_random = _config_draws

    def __init__(self, config: PretrainedConfig, layer: nn.Module) -> None:
        super().__init__()
        self.config_dropout = dropout_rate(config)
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp

    def forward(self, y1: Tensor) -> Tensor:
        return self.mlp(self.post_attention_layernorm(y1))


def initialised_layer(config: PretrainedConfig, layer_idx: int) -> nn.Module:
    """Hugging Face's decoder layer ``layer_idx``, its weights drawn as the plain model draws them."""
    layer = hf_decoder_layer(prepared(config), layer_idx)
    init_normal(layer, config.initializer_range)
    return layer


class DecoderBlock(AdditiveCoupling):
    """Decoder layer ``layer_idx`` of ``config`` as ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)``."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, state: State | None = None) -> None:
        layer = initialised_layer(config, layer_idx)
        super().__init__(DecoderAttention(config, layer), DecoderMLP(config, layer))
        load_into(self, state, f"layer {layer_idx}")


class DecoderAttentionHalf(HalfCoupling):
    """Decoder layer ``layer_idx``'s first half: ``y1 = x1 + F(x2)``, ``y2 = x2``."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, state: State | None = None) -> None:
        super().__init__(DecoderAttention(config, initialised_layer(config, layer_idx)), updates=1)
        load_into(self, state, f"layer {layer_idx}'s attention")


class DecoderMLPHalf(HalfCoupling):
    """Decoder layer ``layer_idx``'s second half: ``y1 = x1``, ``y2 = x2 + G(x1)``."""

    #: takes no key/value cache at generation
    attends = False

    def __init__(self, config: PretrainedConfig, layer_idx: int, state: State | None = None) -> None:
        super().__init__(DecoderMLP(config, initialised_layer(config, layer_idx)), updates=2)
        load_into(self, state, f"layer {layer_idx}'s MLP")


class DecoderNorm(nn.Module):
    """(y1, y2) -> the model's own final norm of their mean."""

    def __init__(self, config: PretrainedConfig, state: State | None = None) -> None:
        super().__init__()
        self.norm = _hf_class(prepared(config), "RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        load_into(self, state, "final norm")

    def draws_random(self) -> bool:
        """An RMS norm draws nothing; a forward hook on it may (``petra_ds.nn.draws``)."""
        return hooked_under(self)

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        y1, y2 = x
        return self.norm((y1 + y2) / 2)


class DecoderHead(nn.Module):
    draws_random = by_children

    def __init__(self, config: PretrainedConfig, state: State | None = None) -> None:
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        init_normal(self, config.initializer_range)
        load_into(self, state, "LM head")

    def forward(self, h: Tensor) -> Tensor:
        return self.lm_head(h)


# --- names: pipeline layer <-> a plain Hugging Face model of the same config ---

_ATTENTION, _MLP = ("self_attn.", "input_layernorm."), ("mlp.", "post_attention_layernorm.")


def _block_prefixes(i: int, grain: str) -> list[dict[str, str]]:
    """A plain model's layer ``i`` -> the pipeline layers it becomes: one block (its F and G), or two halves."""
    attention = {f"model.layers.{i}.{part}": f"F.{part}" for part in _ATTENTION}
    if grain == "half":
        return [attention, {f"model.layers.{i}.{part}": f"F.{part}" for part in _MLP}]
    return [{**attention, **{f"model.layers.{i}.{part}": f"G.{part}" for part in _MLP}}]


def plain_prefixes(config: PretrainedConfig, grain: str = "block") -> list[dict[str, str]]:
    """Per pipeline layer: a plain model's name prefix -> the layer's own prefix."""
    layers: list[dict[str, str]] = [{"model.embed_tokens.": "embed_tokens."}]
    for i in range(config.num_hidden_layers):
        layers += _block_prefixes(i, grain)
    layers.append({"model.norm.": "norm."})
    layers.append({"model.embed_tokens.": "embed_tokens."} if config.tie_word_embeddings else {"lm_head.": "lm_head."})
    return layers


def split_plain_state(config: PretrainedConfig, plain: State, grain: str = "block") -> list[State]:
    """A plain ``*ForCausalLM`` state dict cut into the pipeline layers' state dicts."""
    return split_by_prefix({name: value.detach().clone() for name, value in plain.items()},
                           plain_prefixes(config, grain))


def decoder_layers(config: PretrainedConfig, model: nn.Module | None = None, grain: str = "block") -> list[LayerSpec]:
    """Layer specs of a reversible decoder for ``config``; with ``model`` (a plain ``*ForCausalLM`` of the same
    config, e.g. ``LlamaForCausalLM``) every layer starts from its tensors. ``grain="half"`` makes each decoder
    layer two pipeline layers (attention, then MLP)."""
    prepared(config)
    if grain not in GRAINS:
        raise ValueError(f"decoder grain {grain!r}: use one of {', '.join(GRAINS)}")
    n = config.num_hidden_layers
    kinds = (DecoderAttentionHalf, DecoderMLPHalf) if grain == "half" else (DecoderBlock,)
    states: Sequence[State | None] = [None] * (len(kinds) * n + 3)
    if model is not None:
        states = split_plain_state(config, model.state_dict(), grain)
    blocks = [LayerSpec(kind, config, i, states[1 + len(kinds) * i + h])
              for i in range(n) for h, kind in enumerate(kinds)]
    if config.tie_word_embeddings:
        first = TiedLayerSpec(TIE_KEY, DecoderEmbedding, config, states[0], tied_weight_attr=["embed_tokens.weight"])
        head = TiedLayerSpec(TIE_KEY, DecoderEmbedding, config, states[0], forward_fn=tied_logits,
                             tied_weight_attr=["embed_tokens.weight"])
    else:
        first, head = LayerSpec(DecoderEmbedding, config, states[0]), LayerSpec(DecoderHead, config, states[-1])
    return [first, *blocks, LayerSpec(DecoderNorm, config, states[-2]), head]

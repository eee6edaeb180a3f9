"""A PETRA pipeline from a Hugging Face Reformer, and back.

Hugging Face's ``ReformerLayer`` is already an additive coupling over the streams
``(attn_output, hidden_states)``: ``y1 = x1 + Attention(x2)``, ``y2 = x2 + FeedForward(y1)``. Here its
own ``ReformerAttention`` (local or LSH) and ``ChunkReformerFeedForward`` modules become F and G of a
:class:`~petra_ds.nn.AdditiveCoupling`; Hugging Face's reversible autograd function (which keeps a
per-layer seed attribute and buffers nothing across micro-batches) is not used. Dropout and the LSH
random rotations draw from PETRA's keyed RNG, so a layer's reconstruction sees the same masks and
the same buckets as its forward.

    embedding (non-reversible)   ReformerEmbeddings, copied into both streams (as Hugging Face does)
    ReformerBlock x N            reversible
    head (non-reversible)        cat(y1, y2) -> LayerNorm(2h) -> dropout -> ReformerOnlyLMHead

Weights travel by name: a layer of the pipeline holds exactly the Hugging Face tensors of its part, so
:func:`reformer_state_dict` and :func:`load_layer_files` rebuild a ``ReformerModelWithLMHead`` from
live modules or from a DeepSpeed checkpoint's per-layer files.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from deepspeed.runtime.pipe.module import LayerSpec
from torch import Tensor, nn
from transformers import ReformerConfig, ReformerModelWithLMHead
from transformers.models.reformer.modeling_reformer import (
    ChunkReformerFeedForward,
    ReformerAttention,
    ReformerEmbeddings,
    ReformerOnlyLMHead,
    _get_least_common_mult_chunk_len,
)

from ..nn.coupling import AdditiveCoupling
from .layer_states import State, load_into, split_by_prefix
from .layer_states import load_layer_files as checkpoint_layers


def _check_config(config: ReformerConfig) -> None:
    if not config.is_decoder:
        raise ValueError("the Reformer adapter builds a causal language model: set ReformerConfig(is_decoder=True)")
    if "local" in config.attn_layers and config.local_num_chunks_after != 0:
        raise ValueError("causal local attention needs ReformerConfig(local_num_chunks_after=0)")
    if "lsh" in config.attn_layers and config.lsh_num_chunks_after != 0:
        raise ValueError("causal LSH attention needs ReformerConfig(lsh_num_chunks_after=0)")
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("the Reformer adapter keeps the LM head (2h wide) apart from the embedding (h wide): "
                         "set ReformerConfig(tie_word_embeddings=False)")


def chunk_multiple(config: ReformerConfig) -> int:
    """Training sequence lengths must be a multiple of this (the chunk lengths' least common multiple)."""
    return int(_get_least_common_mult_chunk_len(config))


class ReformerEmbedding(nn.Module):
    """Token (+ axial or plain position) embeddings into the two streams."""

    def __init__(self, config: ReformerConfig, state: State | None = None) -> None:
        super().__init__()
        self.embeddings = ReformerEmbeddings(config)
        self.multiple = chunk_multiple(config)
        load_into(self, state, "embedding")

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        if ids.dim() != 2:
            raise ValueError(f"Reformer expects token ids of shape (batch, seq), got {tuple(ids.shape)}")
        if ids.shape[1] % self.multiple:
            raise ValueError(f"sequence length {ids.shape[1]} is not a multiple of the Reformer chunk length "
                             f"{self.multiple} (lcm of local/LSH chunk lengths); pack sequences to a multiple")
        h = self.embeddings(input_ids=ids)
        return h, h


class _Attention(nn.Module):
    """F: Hugging Face's pre-norm attention (local or LSH) returning only its hidden states."""

    def __init__(self, attention: ReformerAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: Tensor) -> Tensor:
        return self.attention(hidden_states=x).hidden_states


class ReformerBlock(AdditiveCoupling):
    """One Hugging Face ``ReformerLayer`` as a reversible coupling."""

    def __init__(self, config: ReformerConfig, layer_id: int, state: State | None = None) -> None:
        super().__init__(_Attention(ReformerAttention(config, layer_id)), ChunkReformerFeedForward(config))
        load_into(self, state, f"layer {layer_id}")


class ReformerHead(nn.Module):
    """cat(y1, y2) -> LayerNorm(2h) -> dropout -> LM head."""

    def __init__(self, config: ReformerConfig, state: State | None = None) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(2 * config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = config.hidden_dropout_prob
        self.lm_head = ReformerOnlyLMHead(config)
        load_into(self, state, "head")

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        h = self.layer_norm(torch.cat(x, dim=-1))
        h = nn.functional.dropout(h, p=self.dropout, training=self.training)
        return self.lm_head(h)


# --- names: pipeline layer <-> Hugging Face ---

_BLOCK = {"attention.": "F.attention.", "feed_forward.": "G."}
_HEAD = {"reformer.encoder.layer_norm.": "layer_norm.", "lm_head.": "lm_head."}


def _layer_prefixes(config: ReformerConfig) -> list[dict[str, str]]:
    """Per pipeline layer: Hugging Face name prefix -> the layer's own prefix."""
    layers: list[dict[str, str]] = [{"reformer.embeddings.": "embeddings."}]
    for i in range(config.num_hidden_layers):
        layers.append({f"reformer.encoder.layers.{i}.{hf}": own for hf, own in _BLOCK.items()})
    layers.append(dict(_HEAD))
    return layers


def _split_state(config: ReformerConfig, hf_state: State) -> list[State]:
    """A ``ReformerModelWithLMHead`` state dict cut into the pipeline layers' own state dicts."""
    return split_by_prefix(hf_state, _layer_prefixes(config))


def reformer_layers(config: ReformerConfig, model: ReformerModelWithLMHead | None = None) -> list[LayerSpec]:
    """Layer specs of a PETRA pipeline for ``config``; with ``model`` the layers start from its weights."""
    _check_config(config)
    states: Sequence[State | None] = [None] * (config.num_hidden_layers + 2)
    if model is not None:
        hf_state = {n: t.detach().clone() for n, t in model.state_dict().items()}
        states = _split_state(config, hf_state)
    blocks = [LayerSpec(ReformerBlock, config, i, states[i + 1]) for i in range(config.num_hidden_layers)]
    return [LayerSpec(ReformerEmbedding, config, states[0]), *blocks, LayerSpec(ReformerHead, config, states[-1])]


def _layer_to_hf(config: ReformerConfig, index: int, state: State) -> State:
    out = {}
    for hf, own in _layer_prefixes(config)[index].items():
        for name, value in state.items():
            if name.startswith(own):
                out[hf + name[len(own):]] = value
    return out


def reformer_state_dict(config: ReformerConfig, layer_states: Sequence[State]) -> State:
    """Hugging Face names for the pipeline layers' state dicts (in layer order)."""
    expected = config.num_hidden_layers + 2
    if len(layer_states) != expected:
        raise ValueError(f"{len(layer_states)} layer states for a Reformer pipeline of {expected} layers")
    out: State = {}
    for i, state in enumerate(layer_states):
        out.update(_layer_to_hf(config, i, state))
    return out


def to_reformer(config: ReformerConfig, layer_states: Sequence[State]) -> ReformerModelWithLMHead:
    """A ``ReformerModelWithLMHead`` holding the pipeline's weights (``save_pretrained`` it)."""
    model = ReformerModelWithLMHead(config)
    state = reformer_state_dict(config, layer_states)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"pipeline weights do not cover the Reformer (missing {missing}, unexpected {unexpected})")
    return model


def load_layer_files(config: ReformerConfig, checkpoint_dir: str) -> list[State]:
    """The per-layer state dicts of a DeepSpeed pipeline checkpoint (``layer_XX[-model_YY]-model_states.pt``)."""
    return checkpoint_layers(checkpoint_dir, config.num_hidden_layers + 2)


def layer_states(modules: Sequence[Any]) -> list[State]:
    """State dicts of built pipeline layers (e.g. ``PipelineModule.forward_funcs`` on one process)."""
    return [m.state_dict() if isinstance(m, nn.Module) else {} for m in modules]

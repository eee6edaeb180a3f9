"""A decoder-only reversible transformer (RevGPT) as DeepSpeed layer specs.

    embedding (non-reversible)  ids -> (h, h): token + position embedding, dropout, copied into two streams
    N x RevGPTBlock (reversible) y1 = x1 + F(x2), y2 = x2 + G(y1); F = pre-norm causal self-attention
                                 (``scaled_dot_product_attention``), G = pre-norm MLP
                                 (``grain="half"``: each block as two layers, AttentionHalf y1 = x1 + F(x2)
                                 and MLPHalf y2 = x2 + G(y1), so a partition may cut between F and G)
    final norm (non-reversible)  (y1, y2) -> LayerNorm((y1 + y2) / 2)
    LM head (non-reversible)     -> logits; optionally the embedding's weight (``TiedLayerSpec``)

Dropout draws from the keyed RNG (``petra_ds.nn.rng``), so a block's reconstruction sees the masks
of its forward. Under bf16 autocast F and G compute in bf16 while the two residual streams stay in
their own dtype (fp32): the coupling casts F's and G's outputs back before adding or subtracting.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec
from torch import Tensor, nn
from torch.nn import functional as F

from ..nn.coupling import AdditiveCoupling, HalfCoupling
from ..nn.draws import by_children
from .attention import cached_attention_mask

TIE_KEY = "embedding"
#: how finely the blocks are layers: one coupling per block, or its attention and MLP halves
GRAINS = ("block", "half")


@dataclass
class RevGPTConfig:
    vocab_size: int
    seq_len: int
    d_model: int = 256
    n_layers: int = 12
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.1
    tie_embeddings: bool = False
    grain: str = "block"

    def __post_init__(self) -> None:
        if self.grain not in GRAINS:
            raise ValueError(f"RevGPTConfig grain {self.grain!r}: use one of {', '.join(GRAINS)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.n_layers < 1 or self.vocab_size < 1 or self.seq_len < 1:
            raise ValueError(f"RevGPTConfig needs n_layers, vocab_size and seq_len >= 1, got {asdict(self)}")


def init_normal(module: nn.Module, std: float = 0.02) -> None:
    """N(0, std) weights and zero biases for every Linear and Embedding: GPT-2's initialisation at 0.02, Hugging
    Face's Llama-style models' at their ``initializer_range``."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


class Embedding(nn.Module):
    """Token and learned position embeddings, both streams start from the same ``h``."""

    draws_random = by_children  # its dropout decides (``petra_ds.nn.draws``)

    def __init__(self, vocab_size: int, d_model: int, seq_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.dropout = nn.Dropout(dropout)
        init_normal(self)

    def forward(self, ids: Tensor, start: int = 0) -> tuple[Tensor, Tensor]:
        """``start``: the position of the first token (at generation, the tokens already cached)."""
        if ids.dim() != 2:
            raise ValueError(f"RevGPT expects token ids of shape (batch, seq), got {tuple(ids.shape)}")
        if start + ids.shape[1] > self.position.num_embeddings:
            raise ValueError(f"position {start + ids.shape[1] - 1}: the model was built for seq_len "
                             f"{self.position.num_embeddings} (learned positions)")
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        h = self.dropout(self.token(ids) + self.position(positions))
        return h, h

    def logits(self, h: Tensor) -> Tensor:
        """The tied LM head: ``h @ token.weight^T``."""
        return F.linear(h, self.token.weight)


def tied_logits(embedding: nn.Module, h: Tensor) -> Tensor:
    """The LM head of a ``TiedLayerSpec`` that shares an embedding layer: that layer's own ``logits`` (RevGPT's
    and the decoder's embeddings each have one)."""
    return embedding.logits(h)


class CausalSelfAttention(nn.Module):
    """F: pre-norm multi-head causal self-attention.

    ``cache`` (a Hugging Face ``Cache``, at generation) keeps the keys and values of block ``layer``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_dropout = dropout
        self.dropout = nn.Dropout(dropout)

    def draws_random(self) -> bool:
        """Its attention's dropout draws in training when ``attn_dropout > 0``, its output's by its module."""
        return (self.training and self.attn_dropout > 0) or by_children(self)

    def forward(self, x: Tensor, cache: Any = None, layer: int = 0, **_: Any) -> Tensor:
        b, t, d = x.shape
        # (b, t, 3 d) -> q, k, v as (b, heads, t, d / heads) views: three ops, not a split and a view and a transpose
        # each (the same strides, so the same bits)
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4).unbind()
        if cache is not None:
            k, v = cache.update(k, v, layer)
        mask = cached_attention_mask(t, k.shape[2], x.device)
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None and t > 1)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class MLP(nn.Module):
    """G: pre-norm two-layer MLP with GELU."""

    draws_random = by_children

    def __init__(self, d_model: int, ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, ratio * d_model), nn.GELU(),
                                 nn.Linear(ratio * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def init_residual(module: nn.Module, outs: tuple[nn.Linear, ...], n_layers: int) -> None:
    """GPT-2's initialisation, with the residual projections ``outs`` scaled by 1/sqrt(2 N) so the streams do not
    grow with depth."""
    init_normal(module)
    for out in outs:
        nn.init.normal_(out.weight, std=0.02 / (2 * n_layers) ** 0.5)


class RevGPTBlock(AdditiveCoupling):
    """``y1 = x1 + Attention(x2)``, ``y2 = x2 + MLP(y1)``."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, dropout: float = 0.0,
                 n_layers: int = 1) -> None:
        super().__init__(CausalSelfAttention(d_model, n_heads, dropout), MLP(d_model, mlp_ratio, dropout))
        init_residual(self, (self.F.proj, self.G.net[3]), n_layers)


class AttentionHalf(HalfCoupling):
    """``y1 = x1 + Attention(x2)``, ``y2 = x2``: a block's first half."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, n_layers: int = 1) -> None:
        super().__init__(CausalSelfAttention(d_model, n_heads, dropout), updates=1)
        init_residual(self, (self.F.proj,), n_layers)


class MLPHalf(HalfCoupling):
    """``y1 = x1``, ``y2 = x2 + MLP(x1)``: a block's second half."""

    #: takes no key/value cache at generation
    attends = False

    def __init__(self, d_model: int, mlp_ratio: int = 4, dropout: float = 0.0, n_layers: int = 1) -> None:
        super().__init__(MLP(d_model, mlp_ratio, dropout), updates=2)
        init_residual(self, (self.F.net[3],), n_layers)


class FinalNorm(nn.Module):
    """(y1, y2) -> LayerNorm of their mean: one stream for the head."""

    draws_random = by_children

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        y1, y2 = x
        return self.norm((y1 + y2) / 2)


class LMHead(nn.Module):
    draws_random = by_children

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_model, vocab_size, bias=False)
        init_normal(self)

    def forward(self, h: Tensor) -> Tensor:
        return self.linear(h)


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy (labels already shifted; -100 is ignored), computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100)


lm_loss.draws_random = lambda: False  # a cross-entropy (``petra_ds.nn.draws``)


def revgpt_layers(config: RevGPTConfig) -> list[LayerSpec]:
    """Embedding, ``n_layers`` reversible blocks (``2 n_layers`` halves at ``grain="half"``), final norm, LM head:
    one spec per layer."""
    c = config
    embed_args = (c.vocab_size, c.d_model, c.seq_len, c.dropout)
    if c.tie_embeddings:
        first = TiedLayerSpec(TIE_KEY, Embedding, *embed_args, tied_weight_attr=["token.weight"])
        head = TiedLayerSpec(TIE_KEY, Embedding, *embed_args, forward_fn=tied_logits, tied_weight_attr=["token.weight"])
    else:
        first, head = LayerSpec(Embedding, *embed_args), LayerSpec(LMHead, c.d_model, c.vocab_size)
    if c.grain == "half":
        blocks = [spec for _ in range(c.n_layers) for spec in (
            LayerSpec(AttentionHalf, c.d_model, c.n_heads, c.dropout, c.n_layers),
            LayerSpec(MLPHalf, c.d_model, c.mlp_ratio, c.dropout, c.n_layers))]
    else:
        blocks = [LayerSpec(RevGPTBlock, c.d_model, c.n_heads, c.mlp_ratio, c.dropout, c.n_layers)
                  for _ in range(c.n_layers)]
    return [first, *blocks, LayerSpec(FinalNorm, c.d_model), head]

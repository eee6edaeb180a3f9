"""A small mixed reversible / non-reversible model and its data, for examples, benchmarks and tests.

The toy model (:func:`toy_layer_specs`): a non-reversible stem, additive and swap couplings, non-reversible
mixing layers and a classification head on ``IN_FEATURES`` features, trained on :func:`toy_data` (the
label is the argmax of the first ``CLASSES`` features, a rule it can learn). :func:`revgpt_tiny_config`
is a RevGPT and :func:`decoder_tiny_config` a Hugging Face decoder config small enough for float64 oracles,
both trained on :func:`token_data`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..nn import AdditiveCoupling, SwapCoupling

WIDTH = 4
IN_FEATURES = 6
CLASSES = 3


def _mlp(dropout: float, batchnorm: bool = False) -> nn.Module:
    norm = [nn.BatchNorm1d(2 * WIDTH)] if batchnorm else []
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), *norm, nn.Tanh(), nn.Dropout(dropout),
                         nn.Linear(2 * WIDTH, WIDTH))


class Stem(nn.Module):
    """Non-reversible: features to a pair of streams."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(IN_FEATURES, 2 * WIDTH)

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        return y[:, :WIDTH], y[:, WIDTH:]


class Mix(nn.Module):
    """Non-reversible: mixes the two streams (a stand-in for a downsampling block)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * WIDTH, 2 * WIDTH)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        y = self.dropout(torch.tanh(self.linear(torch.cat(x, dim=1))))
        return y[:, :WIDTH], y[:, WIDTH:]


class Additive(AdditiveCoupling):
    def __init__(self, dropout: float = 0.0, batchnorm: bool = False) -> None:
        super().__init__(_mlp(dropout, batchnorm), _mlp(dropout, batchnorm))


class Swap(SwapCoupling):
    def __init__(self, dropout: float = 0.0, batchnorm: bool = False) -> None:
        super().__init__(_mlp(dropout, batchnorm))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, x):
        return self.linear(torch.cat(x, dim=1))


def toy_layer_specs(dropout: float = 0.0, batchnorm: bool = False) -> list:
    """Stem, Additive, Mix, Swap, Additive, Swap, Mix, Additive, Head (9 layers); ``batchnorm`` puts a
    BatchNorm1d inside every coupling's functions."""
    from deepspeed.runtime.pipe.module import LayerSpec

    bn = batchnorm
    return [
        LayerSpec(Stem), LayerSpec(Additive, dropout, bn), LayerSpec(Mix, dropout), LayerSpec(Swap, dropout, bn),
        LayerSpec(Additive, dropout, bn), LayerSpec(Swap, dropout, bn), LayerSpec(Mix),
        LayerSpec(Additive, dropout, bn), LayerSpec(Head),
    ]


def toy_data(num: int, micro_batch: int, seed: int = 0, dtype=torch.float64) -> list[tuple]:
    """``num`` global micro-batches of ``micro_batch`` samples; the label is the argmax of the first
    ``CLASSES`` features, so the toy model can learn it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        x = torch.randn(micro_batch, IN_FEATURES, generator=g, dtype=dtype)
        out.append((x, x[:, :CLASSES].argmax(dim=1)))  # a learnable rule
    return out


VOCAB, SEQ_LEN = 11, 6


def revgpt_tiny_config(dropout: float = 0.0, tie_embeddings: bool = False, grain: str = "block"):
    """A RevGPT small enough for float64 oracles: 4 blocks, 7 layers (11 at ``grain="half"``)."""
    from ..models.transformer import RevGPTConfig

    return RevGPTConfig(vocab_size=VOCAB, seq_len=SEQ_LEN, d_model=8, n_layers=4, n_heads=2, mlp_ratio=2,
                        dropout=dropout, tie_embeddings=tie_embeddings, grain=grain)


def decoder_tiny_config(model_type: str = "llama", hidden: int = 8, layers: int = 4, dropout: float = 0.0,
                        tie_embeddings: bool = False, **extra: Any):
    """A Hugging Face causal-LM config (``model_type``: llama, qwen2, qwen3, mistral) for the reversible decoder:
    grouped-query attention (2 query heads share 1 key/value head), SwiGLU of 2 x ``hidden``; ``extra`` goes to
    the config as its own keyword arguments."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                head_dim=hidden // 2, max_position_embeddings=4 * SEQ_LEN,
                                attention_dropout=dropout, tie_word_embeddings=tie_embeddings, **extra)


def token_data(num: int, micro_batch: int, seed: int = 0, dtype=None) -> list[tuple]:
    """``num`` micro-batches of (ids, next ids) where the next token is the current one plus one
    (mod ``VOCAB``) most of the time: learnable, with some noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        start = torch.randint(0, VOCAB, (micro_batch, 1), generator=g)
        ids = (start + torch.arange(SEQ_LEN + 1)) % VOCAB
        noise = torch.rand(ids.shape, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(0, VOCAB, ids.shape, generator=g), ids)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out

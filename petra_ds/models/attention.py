"""Causal attention with a key/value cache: which mask a query block needs.

Without a cache (training, or a prompt's first pass) the queries and keys are the same positions and SDPA's
``is_causal`` is the mask. With a cache the keys run ``kv_len - q_len`` positions ahead of the queries: one new
token sees every key (no mask), a block of several needs the causal mask aligned at its bottom-right, which
``is_causal`` (aligned top-left) is not.
"""

from __future__ import annotations

import torch
from torch import Tensor


def cached_attention_mask(q_len: int, kv_len: int, device: torch.device) -> Tensor | None:
    """None where SDPA's own choice is right (``q_len == kv_len``: causal; ``q_len == 1``: all keys), else a
    boolean (1, 1, q_len, kv_len) mask, True where query i may see key j (``j <= i + kv_len - q_len``)."""
    if q_len == kv_len or q_len == 1:
        return None
    if q_len > kv_len:
        raise ValueError(f"{q_len} queries against {kv_len} keys: the cache must hold the queries' own keys")
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)[None, None]

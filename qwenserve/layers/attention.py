"""Attention over a KV cache. The layer knows its heads; the cache object passed to forward knows where
K/V live and which keys each query may see (a contiguous per-sequence cache for now)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: "ContiguousKVCache") -> torch.Tensor:
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        return kv_cache.attend(self.layer_idx, q, k, v, self.scale).reshape(q.shape[0], -1)


class ContiguousKVCache:
    """K/V of one sequence in preallocated [max_len, kv_heads, head_dim] tensors, one pair per layer.

    `start` is the number of tokens already cached; each forward appends its tokens at that offset and
    `advance` moves it once every layer has run."""

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (max_len, num_kv_heads, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.start = 0

    def advance(self, num_tokens: int) -> None:
        self.start += num_tokens

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        t, end = q.shape[0], self.start + q.shape[0]
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache of {self.max_len}")
        self.k[layer][self.start:end] = k
        self.v[layer][self.start:end] = v
        keys = self.k[layer][:end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, end, d]
        values = self.v[layer][:end].transpose(0, 1).unsqueeze(0)
        query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, t, d]
        mask = None
        if self.start and t > 1:  # a chunk after cached tokens: query i sees keys up to start + i
            mask = torch.ones(t, end, dtype=torch.bool, device=q.device).tril(diagonal=self.start)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                             is_causal=(self.start == 0 and t > 1), enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)  # [t, heads, d]

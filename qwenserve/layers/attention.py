"""The attention layer: its heads and scale. Where K/V live and which keys each query sees is the business of
the batch object passed to forward (`paged_attention.PagedBatch`); the layer only hands it q, k and v."""
from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch) -> torch.Tensor:
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        return batch.attend(self.layer_idx, q, k, v, self.scale).reshape(q.shape[0], -1)

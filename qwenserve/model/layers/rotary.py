"""Rotary position embedding (neox style: the two halves of each head rotate together), with the
linear, dynamic-NTK and YaRN scalings computed exactly as HF transformers computes them."""
from __future__ import annotations

import math

import torch
from torch import nn

from qwenserve.kernels import cpu_ops_for


def _inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    original_max = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # high frequencies keep their original speed
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, original_max_position: int,
                 scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self.scaling = scaling
        self.original_max_position = original_max_position
        kind = scaling["rope_type"] if scaling else None
        attention_factor = 1.0
        if kind == "yarn":
            scaling = dict(scaling)
            scaling.setdefault("original_max_position_embeddings", original_max_position)
            inv_freq, attention_factor = _yarn_inv_freq(head_dim, base, scaling)
        else:
            inv_freq = _inv_freq(head_dim, base)
            if kind == "linear":
                inv_freq = inv_freq / scaling["factor"]
        self.attention_factor = attention_factor
        # dynamic NTK changes the frequencies with the sequence length, beyond the original context only
        self.dynamic = kind == "dynamic"
        table_len = original_max_position if self.dynamic else max_position
        # computed in float32, stored in the run dtype: HF casts cos/sin to the activations' dtype before use
        self._ops = cpu_ops_for(torch.empty(0).device)  # chosen once: the kernel rotates q and k in place
        self.register_buffer("cos_sin", self._cos_sin(torch.arange(table_len), inv_freq).to(torch.get_default_dtype()),
                             persistent=False)

    def _cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * inv_freq[None, :]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.attention_factor

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        factor = self.scaling["factor"]
        base = self.base * ((factor * seq_len / self.original_max_position) - (factor - 1)) ** (
            self.head_dim / (self.head_dim - 2))
        return _inv_freq(self.head_dim, base)

    def _table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos/sin table, index of each position in it)."""
        if self.dynamic and int(positions.max()) + 1 > self.original_max_position:
            table = self._cos_sin(positions, self._dynamic_inv_freq(int(positions.max()) + 1))
            return table.to(self.cos_sin.dtype), torch.arange(len(positions), device=positions.device)
        return self.cos_sin, positions

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim], positions: [T]."""
        table, index = self._table(positions)
        cos, sin = table[index].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int):
        """The fused projection's output [T, (heads + 2 kv_heads) * head_dim] -> rotated q [T, heads, d],
        rotated k and v [T, kv_heads, d]. The CPU kernel rotates in place inside qkv."""
        t, d = qkv.shape[0], self.head_dim
        if self._ops is not None:
            qkv = qkv.contiguous()
            table, index = self._table(positions)
            self._ops.rotary_embedding(qkv, index, table, num_heads + num_kv_heads, d)
        q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
        q, k, v = q.view(t, num_heads, d), k.view(t, num_kv_heads, d), v.view(t, num_kv_heads, d)
        return (q, k, v) if self._ops is not None else (*self.forward(positions, q, k), v)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

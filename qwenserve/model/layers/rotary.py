"""Rotary position embedding (neox style: the two halves of each head rotate together), with the
linear, dynamic-NTK and YaRN scalings computed exactly as HF transformers computes them."""
from __future__ import annotations

import math

import numpy as np
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


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding (Qwen2-VL's M-RoPE): the head's rotary frequencies are cut into three sections
    (mrope_section, e.g. 16/24/24 of 64) that rotate by a token's temporal, height and width position. Positions
    are [3, T]; a text token has the same value in all three, which makes it plain RoPE. The rotation is the
    parent's (the same kernel): only the cos/sin rows differ, assembled per token from the three positions."""

    def __init__(self, head_dim: int, max_position: int, base: float, original_max_position: int,
                 scaling: dict | None, mrope_section: tuple[int, ...]):
        super().__init__(head_dim, max_position, base, original_max_position, scaling)
        half = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))  # section of each frequency
        self.register_buffer("section_of_column", torch.cat([half, half]), persistent=False)  # cos half, sin half

    def _table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super()._table(positions)
        rows = self.cos_sin[positions]  # [3, T, head_dim]: each axis' table rows
        picked = rows.gather(0, self.section_of_column.expand(1, positions.shape[1], -1)).squeeze(0)
        return picked, torch.arange(positions.shape[1], device=positions.device)


def mrope_positions(num_tokens: int, images: list[tuple], spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """M-RoPE positions [3, num_tokens] of a prompt, as transformers' Qwen2-VL get_rope_index computes them, and
    the delta that later tokens add to their index (position = index + delta on all three axes).
    images: (index of the image's first placeholder token, its patch grid (t, h, w)[, time interval]) in prompt
    order; a video is an image of t frames. Text continues one past where the previous text or image left off; an
    image's tokens take (frame, row, column) of the merged grid, offset by that start, the frame's position scaled
    by the time interval (floored; Qwen2.5-VL spaces a video's frames by their time), and the text after it starts
    at start + max(rows, columns). The delta is one past the largest position, less the prompt's length."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    index = next_position = 0
    for first, (t, h, w), *interval in sorted(images, key=lambda image: image[0]):
        text = first - index
        out[:, index:first] = np.arange(next_position, next_position + text)
        next_position += text
        h, w = h // spatial_merge_size, w // spatial_merge_size
        # in float32, as transformers multiplies (a float32 tensor), so the floor falls the same way
        frames = (np.arange(t, dtype=np.float32) * np.float32(interval[0] if interval else 1.0)).astype(np.int64)
        grid = np.stack(np.meshgrid(frames, np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        out[:, first:first + t * h * w] = grid + next_position
        index = first + t * h * w
        next_position += max(h, w)
    out[:, index:] = np.arange(next_position, next_position + num_tokens - index)
    return out, int(out.max()) + 1 - num_tokens

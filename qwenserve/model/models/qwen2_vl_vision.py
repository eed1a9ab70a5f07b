"""The vision towers of Qwen2-VL and Qwen2.5-VL: image patches in, one row per language-model token out.

Both are ViTs over 14x14 patches (two frames deep: the processor repeats a still image) with a 2-D rotary embedding
(a quarter of each head's frequencies follow the patch's row, a quarter its column, each pair twice) and a patch
merger that turns each 2x2 block of neighbouring patches into one token of the language model's width. The
processor already orders patches block by block (processor.py), so a block's four patches are consecutive rows.
- Qwen2-VL: LayerNorm, an fc1 / quick-GELU / fc2 MLP, every block attending over the whole image.
- Qwen2.5-VL: RMSNorm, a gated SiLU MLP, and window attention: most blocks attend only within windows of
  window_size pixels (8x8 patches at the published 112), a few (fullatt_block_indexes) over the whole image. The
  patches are reordered window by window for the blocks and back after the merger.
Attention never crosses an image (or a video frame). Module and parameter names are the checkpoints' (visual.*),
so loading needs no table beyond gate/up -> gate_up_proj. The tower runs in the run dtype, replicated on every
tensor-parallel rank of the first pipeline stage: it is small beside the language model."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.config.model_config import VisionConfig
from qwenserve.model.layers.layernorm import RMSNorm
from qwenserve.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear

Grid = tuple[int, int, int]  # (frames / temporal_patch_size, patch rows, patch columns), as image_grid_thw


def _activation(name: str):
    """transformers' ACT2FN for the names VisionConfig accepts."""
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    return F.silu  # silu, swish


def patch_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """[patches, 2]: each patch's (row, column) in its image, in the processor's order (2x2 blocks in row-major
    order of blocks, row-major within a block; frames one after another)."""
    out = []
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = [a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)
                  for a in (rows, cols)]
        out.append(np.tile(np.stack(blocks, axis=-1), (t, 1)))
    return torch.from_numpy(np.concatenate(out))


def frame_lengths(grids: list[Grid]) -> list[int]:
    """Patches per attention segment without windows: one per frame of each image."""
    return [h * w for t, h, w in grids for _ in range(t)]


def window_order(grids: list[Grid], merge: int, window_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: (the merged tokens' order, window by window, row-major within each; the patches in
    each window) for windows of window_tokens x window_tokens merged tokens, per frame, cut from the top left."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        index = np.arange(t * rows * cols).reshape(t, rows, cols) + base
        for frame in index:
            for r in range(0, rows, window_tokens):
                for c in range(0, cols, window_tokens):
                    window = frame[r:r + window_tokens, c:c + window_tokens].reshape(-1)
                    order.append(window)
                    lengths.append(len(window) * merge * merge)
        base += t * rows * cols
    return torch.from_numpy(np.concatenate(order)), lengths


class VisionRotary(nn.Module):
    """cos/sin [patches, head_dim] from each patch's (row, column)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        quarter = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (positions.to(self.inv_freq.device)[..., None].float() * self.inv_freq).flatten(1)  # rows, cols
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation in float32 (as the reference does), back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = ColumnParallelLinear(dim, 3 * dim, bias=True)
        self.proj = ColumnParallelLinear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
        out = torch.empty_like(q)
        start = 0
        for length in lengths:  # each segment (image, frame or window) attends only to itself
            part = slice(start, start + length)
            # [1, heads, length, head_dim]: PyTorch's CPU flash attention takes 4-D inputs only (3-D ones run the
            # math path, 2.5x slower on a 448x448 image's 1024 patches)
            q_, k_, v_ = (t[part].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out[part] = F.scaled_dot_product_attention(q_, k_, v_)[0].transpose(0, 1)
            start += length
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL's fc1 -> activation -> fc2."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden, bias=True)
        self.fc2 = ColumnParallelLinear(hidden, dim, bias=True)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL's act(gate) * up -> down, with biases; gate and up in one matrix."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(dim, [hidden, hidden], bias=True)
        self.down_proj = ColumnParallelLinear(hidden, dim, bias=True)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def _norm(config: VisionConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, 1e-6) if config.windowed else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        dim = config.hidden_size
        self.norm1, self.norm2 = _norm(config, dim), _norm(config, dim)
        self.attn = VisionAttention(dim, config.num_heads)
        mlp = GatedVisionMLP if config.windowed else VisionMLP
        self.mlp = mlp(dim, config.intermediate_size, config.hidden_act)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 block of patches (consecutive rows) -> one token of the language model's width."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merged = config.hidden_size * config.merge_unit
        self.ln_q = _norm(config, config.hidden_size)
        self.mlp = nn.Sequential(ColumnParallelLinear(self.merged, self.merged, bias=True), nn.GELU(),
                                 ColumnParallelLinear(self.merged, config.out_hidden_size, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d over (channels, frames, rows, columns) patches, whose stride equals its kernel: one
    matrix product over each flattened patch."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        c, t, p = config.in_channels, config.temporal_patch_size, config.patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(config.hidden_size, c, t, p, p), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return pixels.to(weight.dtype) @ weight.view(weight.shape[0], -1).T


class VisionTransformer(nn.Module):
    """Either tower (config.windowed picks Qwen2.5-VL's)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rotary_pos_emb = VisionRotary(config.hidden_size // config.num_heads, config.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """pixels [patches, channels * temporal_patch * patch * patch] of one or more images (the processor's
        pixel_values), grids their (t, h, w) -> [patches / 4, out_hidden_size], images one after another."""
        cfg = self.config
        x = self.patch_embed(pixels)
        cos, sin = self.rotary_pos_emb(patch_positions(grids, cfg.spatial_merge_size))
        whole = frame_lengths(grids)
        if not cfg.windowed:
            for block in self.blocks:
                x = block(x, cos, sin, whole)
            return self.merger(x)
        order, windows = window_order(grids, cfg.spatial_merge_size, cfg.window_tokens)
        order = order.to(x.device)

        def by_window(t: torch.Tensor) -> torch.Tensor:  # reorder whole 2x2 blocks, which stay together
            return t.view(-1, cfg.merge_unit, t.shape[-1])[order].view(-1, t.shape[-1])
        x, cos, sin = by_window(x), by_window(cos), by_window(sin)
        for i, block in enumerate(self.blocks):
            # whole-image blocks keep per-frame segments: windows never cross a frame, so frames stay contiguous
            x = block(x, cos, sin, whole if i in cfg.fullatt_block_indexes else windows)
        return self.merger(x)[torch.argsort(order)]

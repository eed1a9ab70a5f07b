"""Attention over the paged KV cache for one flat batch of sequences.

The cache of each layer is two tensors of [num_blocks, block_size, kv_heads, head_dim] (`PagedKVCache`, owned
by the worker). Each step the model runner describes its batch once (`AttentionMetadata`: where the new K/V
go, which blocks each sequence reads); every attention layer then writes the batch's new K/V into their
slots and reads each sequence's keys through its block table:
- decode tokens (one new token per sequence): with the CPU kernel, one pass that reads each sequence's keys
  in place in its blocks; otherwise a few batched SDPAs, grouped by context length, keys gathered per sequence;
- prompt chunks run one sequence each, causally, against their cached context if they have one.
All new K/V are written before any are read, so sequences sharing prefix blocks in one step see them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.kernels import cpu_ops_for


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: padded reads of never-written slots must be finite (they are masked, but NaN * 0 = NaN)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


@dataclass
class DecodeGroup:
    token_index: torch.Tensor | None  # rows of the flat batch; None when the batch is decode tokens only
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0
    context_len: int  # keys to read (the longest context)
    mask: torch.Tensor | None  # [B, 1, 1, context_len], True = visible; None when all contexts are equal
    context_lens: torch.Tensor | None = None  # [B] int64: set when the group is built for the CPU kernel


@dataclass
class PrefillSpan:
    start: int  # rows [start, end) of the flat batch
    end: int
    block_table: torch.Tensor | None  # None: no cached context, attend to this chunk only
    context_len: int  # cached + new tokens


@dataclass
class AttentionMetadata:
    """What the attention layers need to know about one step's batch."""
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T]: the cache slot of each new token
    decode: list[DecodeGroup]
    prefills: list[PrefillSpan]


def decode_kernel_available(device: torch.device | str) -> bool:
    """Whether decode attention runs on our CPU kernel (then the runner builds one group with context_lens)."""
    return cpu_ops_for(device) is not None


class Attention(nn.Module):
    """The attention of one layer: its heads and scale; its implementation is chosen once, here."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self._ops = cpu_ops_for(torch.empty(0).device)  # the device the model is being built on
        self._decode = self._decode_kernel if self._ops is not None else self._decode_sdpa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata):
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] (this step's tokens) -> [T, heads * head_dim]."""
        md = attn_metadata
        k_cache, v_cache = md.kv_cache.k[self.layer_idx], md.kv_cache.v[self.layer_idx]
        flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, md.slot_mapping, k)
        flat_v.index_copy_(0, md.slot_mapping, v)

        if len(md.decode) == 1 and md.decode[0].token_index is None:  # decode tokens only, one group
            out = self._decode(q, k_cache, v_cache, md.decode[0])
        else:
            out = torch.empty_like(q)
            for d in md.decode:
                out[d.token_index] = self._decode(q[d.token_index], k_cache, v_cache, d)
            for span in md.prefills:
                out[span.start:span.end] = self._prefill(q, k, v, k_cache, v_cache, span)
        return out.reshape(q.shape[0], -1)

    @staticmethod
    def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
        """[..., blocks] block ids -> [..., kv_heads, length, d] keys or values."""
        num_blocks, block_size, kv_heads, d = cache.shape
        # index_select over whole blocks: about 9x faster on CPU than advanced indexing with a 2-D index
        g = cache.view(num_blocks, -1).index_select(0, block_tables.reshape(-1))
        g = g.view(*block_tables.shape[:-1], block_tables.shape[-1] * block_size, kv_heads, d)[..., :length, :, :]
        return g.transpose(-3, -2)

    def _decode_kernel(self, q, k_cache, v_cache, d: DecodeGroup):
        out = q.new_empty(q.shape)
        self._ops.paged_decode_attention(out, q, k_cache, v_cache, d.block_tables, d.context_lens, self.scale)
        return out

    def _decode_sdpa(self, q, k_cache, v_cache, d: DecodeGroup):
        keys = self._gather(k_cache, d.block_tables, d.context_len)  # [B, kv_heads, S, d]
        values = self._gather(v_cache, d.block_tables, d.context_len)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=d.mask, scale=self.scale,
                                             enable_gqa=True)  # [B, heads, 1, d]
        return out.squeeze(2)

    def _prefill(self, q, k, v, k_cache, v_cache, span: PrefillSpan):
        query = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        n = span.end - span.start
        if span.block_table is None:
            keys = k[span.start:span.end].transpose(0, 1).unsqueeze(0)
            values = v[span.start:span.end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=n > 1, scale=self.scale,
                                                 enable_gqa=True)
        else:
            keys = self._gather(k_cache, span.block_table, span.context_len).unsqueeze(0)
            values = self._gather(v_cache, span.block_table, span.context_len).unsqueeze(0)
            past = span.context_len - n  # query i sits at position past + i and sees keys 0..past + i
            mask = torch.ones(n, span.context_len, dtype=torch.bool, device=q.device).tril(diagonal=past)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

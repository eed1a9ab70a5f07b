"""Attention over the paged KV cache for one flat batch of sequences.

The cache of each layer is two tensors of [num_blocks, block_size, kv_heads, head_dim] (`PagedKVCache`, owned
by the worker): in the run dtype, or (kv_cache_dtype) int8 / fp8 codes with a bf16 scale per token and kv head
beside them; the cache picks its write and gather once, when built, and the decode kernel reads codes and scales
in place. Each step the model runner describes its batch once (`AttentionMetadata`: where the new K/V
go, which blocks each sequence reads); every attention layer then writes the batch's new K/V into their
slots and reads each sequence's keys through its block table:
- decode tokens (one new token per sequence): with the CPU kernel, one pass that reads each sequence's keys
  in place in its blocks; otherwise a few batched SDPAs, grouped by context length, keys gathered per sequence;
- prompt chunks run one sequence each, causally, against their cached context if they have one (a chunk without
  cached context, in bf16, on our flash kernel where the CPU has AVX512-BF16; otherwise torch's SDPA).
All new K/V are written before any are read, so sequences sharing prefix blocks in one step see them.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.kernels import cpu_ops_for


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds one-byte codes (int8, fp8) with per-token, per-head scales."""
    return dtype.itemsize == 1


# The scales' dtype: 2 bytes beside head_dim code bytes (head_dim 64, Qwen2.5-0.5B: 66 bytes a token and head
# against 128 in bf16, 1.94x the tokens, where float32 scales gave 1.88x; head_dim 128, the larger ones: 1.97x).
# bf16, not fp16: it spans fp8 e5m2's small scales (amax / 57344), and its coarser rounding costs nothing because
# the codes are computed against the rounded scale.
KV_SCALE_DTYPE = torch.bfloat16
E4M3_MAX = 448.0  # the largest float8_e4m3fn value, the range checkpoints' KV scales are calibrated for


def quantize_kv(x: torch.Tensor, dtype: torch.dtype,
                static: float | tuple[float, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] -> (codes in dtype, KV_SCALE_DTYPE scales [...]): scale = amax(|x|) / the code's largest
    value, rounded to the scale dtype, and codes x / scale (int8 rounded to nearest); a zero vector gets scale 0
    and codes 0. static: a checkpoint's calibrated scale (k_scale / v_scale, made for e4m3 codes), one for the
    tensor or one per head (x's second-to-last dimension), in place of amax / top, stretched to this dtype's
    range; values past it saturate."""
    x = x.float()
    top = torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max
    if static is None:
        scale = (x.abs().amax(dim=-1) / top).to(KV_SCALE_DTYPE)
    elif isinstance(static, tuple):
        per_head = torch.tensor([s * E4M3_MAX / top for s in static], dtype=KV_SCALE_DTYPE, device=x.device)
        scale = per_head.expand(x.shape[:-1])
    else:
        scale = torch.full(x.shape[:-1], static * E4M3_MAX / top, dtype=KV_SCALE_DTYPE, device=x.device)
    y = x / torch.where(scale > 0, scale.float(), 1.0).unsqueeze(-1)
    if not dtype.is_floating_point:
        y = y.round()
    return y.clamp_(-top, top).to(dtype), scale  # clamp: amax / scale may round just past top (e5m2 -> inf)


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim] and scales [..., 1] (broadcast) -> values in dtype."""
    return (codes.float() * scales.float()).to(dtype)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[..., blocks] block ids -> [..., kv_heads, length, d] keys or values."""
    num_blocks, block_size, kv_heads, d = cache.shape
    # index_select over whole blocks: about 9x faster on CPU than advanced indexing with a 2-D index
    g = cache.view(num_blocks, -1).index_select(0, block_tables.reshape(-1))
    g = g.view(*block_tables.shape[:-1], block_tables.shape[-1] * block_size, kv_heads, d)[..., :length, :, :]
    return g.transpose(-3, -2)


def untouched_zeros(specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """Zero tensors of these (shape, dtype)s. On the CPU (Linux, macOS) they share one private anonymous mapping,
    each on a page boundary, and nothing writes them here: the kernel backs a page with memory only when it is
    first written (reading an untouched page maps the shared zero page), whatever the process's allocator does
    with large allocations. Elsewhere (CUDA, where memory is committed when allocated anyway) torch.zeros."""
    if device.type != "cpu" or not hasattr(mmap, "MAP_PRIVATE"):
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = mmap.mmap(-1, max(end, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE)  # the tensors keep it alive
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    return [whole[offset:offset + size].view(dtype).view(shape)
            for (shape, dtype), offset, size in zip(specs, offsets, sizes)]


class PagedKVCache:
    """Per layer, K and V of [num_blocks, block_size, kv_heads, head_dim] in `dtype`; for int8 / fp8 those are
    codes, and k_scales / v_scales hold their scales [num_blocks, block_size, kv_heads] in KV_SCALE_DTYPE (else
    None).

    On the CPU every tensor lives in one anonymous mapping of the cache's own (`untouched_zeros`): memory reserved,
    not resident, until a block's slots are first written, so resident memory follows the blocks the scheduler has
    handed out (core/kv_cache_manager.py keeps those near the peak in use, fresh ones lowest id first). Slots never
    written read as zeros, which padded reads rely on: they are masked, but must be finite (NaN * 0 = NaN)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        quantized = is_quantized(dtype)
        per_layer = [(shape, dtype), (shape, dtype)] + ([(shape[:3], KV_SCALE_DTYPE)] * 2 if quantized else [])
        tensors = iter(untouched_zeros(per_layer * num_layers, torch.device(device)))
        self.k, self.v, self.k_scales, self.v_scales = [], [], [], []
        for _ in range(num_layers):
            self.k.append(next(tensors))
            self.v.append(next(tensors))
            self.k_scales.append(next(tensors) if quantized else None)
            self.v_scales.append(next(tensors) if quantized else None)
        self.block_size = block_size
        self.write = self._write_quantized if quantized else self._write
        self.gather = self._gather_dequantized if quantized else self._gather

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        per_head = head_dim * dtype.itemsize + (KV_SCALE_DTYPE.itemsize if is_quantized(dtype) else 0)  # + a scale
        return 2 * num_layers * block_size * num_kv_heads * per_head

    def _write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, static=None) -> None:
        """This step's k/v [T, kv_heads, head_dim] into their slots. static: the layer's (k, v) scales from the
        checkpoint (either None: dynamic), which only a cache of codes uses."""
        for cache, x in ((self.k[layer], k), (self.v[layer], v)):
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x)

    def _write_quantized(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         static=None) -> None:
        k_static, v_static = static or (None, None)
        for cache, scales, x, fixed in ((self.k[layer], self.k_scales[layer], k, k_static),
                                        (self.v[layer], self.v_scales[layer], v, v_static)):
            codes, scale = quantize_kv(x, cache.dtype, fixed)
            # copied as bytes: index_copy_ has no fp8 kernel on the CPU
            cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slots, codes.view(torch.uint8))
            scales.view(-1, scales.shape[2]).index_copy_(0, slots, scale)

    def _gather(self, layer: int, block_tables: torch.Tensor, length: int, dtype: torch.dtype):
        """(keys, values) [..., kv_heads, length, head_dim] of the blocks in block_tables, in dtype (the query's,
        which a plain cache already holds)."""
        return gather_blocks(self.k[layer], block_tables, length), gather_blocks(self.v[layer], block_tables, length)

    def _gather_dequantized(self, layer: int, block_tables: torch.Tensor, length: int, dtype: torch.dtype):
        return tuple(dequantize_kv(gather_blocks(codes, block_tables, length),
                                   gather_blocks(scales.unsqueeze(-1), block_tables, length), dtype)
                     for codes, scales in ((self.k[layer], self.k_scales[layer]),
                                           (self.v[layer], self.v_scales[layer])))


@dataclass
class DecodeGroup:
    token_index: torch.Tensor | None  # rows of the flat batch; None when the batch is decode tokens only
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0
    context_len: int  # keys to read (the longest context)
    mask: torch.Tensor | None  # [B, 1, 1, context_len], True = visible; None when all contexts are equal
    context_lens: torch.Tensor | None = None  # [B] int64: set when the group is built for the CPU kernel
    # each sequence's length and prompt length (dual-chunk attention's chunks and temperature)
    seq_lens: tuple[int, ...] = ()
    prompt_lens: tuple[int, ...] = ()


@dataclass
class PrefillSpan:
    start: int  # rows [start, end) of the flat batch
    end: int
    block_table: torch.Tensor | None  # None: no cached context, attend to this chunk only
    context_len: int  # cached + new tokens
    prompt_len: int = 0  # the sequence's prompt length (dual-chunk attention's temperature); 0: unknown


@dataclass
class AttentionMetadata:
    """What the attention layers need to know about one step's batch."""
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T]: the cache slot of each new token
    decode: list[DecodeGroup]
    prefills: list[PrefillSpan]
    # which adapter each token runs with (lora/batch.py's LoRABatch), for the projections an adapter wraps; the
    # model only passes it on. None when no token of the step has one: the base model then runs as it is
    lora: Any = None


def decode_kernel_available(device: torch.device | str) -> bool:
    """Whether decode attention runs on our CPU kernel (then the runner builds one group with context_lens)."""
    return cpu_ops_for(device) is not None


class Attention(nn.Module):
    """The attention of one layer: its heads and scale; its implementation is chosen once, here."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kv_heads: tuple[int, int] | None = None):
        """kv_heads: (the checkpoint's kv heads, the first of this rank's among them) under tensor parallelism;
        None: this rank holds all num_kv_heads."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.checkpoint_kv_heads, self.first_kv_head = kv_heads or (num_kv_heads, 0)
        self.head_dim = head_dim
        self.scale = scale
        # (k, v) scales from the checkpoint for a cache of codes (load_kv_scale), each a float (per tensor) or a
        # tuple of this rank's heads' (per head); None: dynamic
        self.kv_scales = None
        self._ops = cpu_ops_for(torch.empty(0).device)  # the device the model is being built on
        self._decode = self._decode_kernel if self._ops is not None else self._decode_sdpa
        # a prompt chunk in a bf16 model (the default dtype while it is built): our flash kernel, from the chunk's
        # own keys or, after cached context, from a bf16 cache
        self._bf16_prefill = (self._ops is not None and torch.get_default_dtype() == torch.bfloat16
                              and self._ops.prefill_attention_supported(head_dim))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata):
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] (this step's tokens) -> [T, heads * head_dim]."""
        md = attn_metadata
        cache = md.kv_cache
        cache.write(self.layer_idx, md.slot_mapping, k, v, self.kv_scales)

        if len(md.decode) == 1 and md.decode[0].token_index is None:  # decode tokens only, one group
            out = self._decode(q, cache, md.decode[0])
        else:
            out = torch.empty_like(q)
            for d in md.decode:
                out[d.token_index] = self._decode(q[d.token_index], cache, d)
            for span in md.prefills:
                self._prefill(q, k, v, cache, span, out[span.start:span.end])
        return out.reshape(q.shape[0], -1)

    def load_kv_scale(self, which: str, loaded: torch.Tensor) -> None:
        """A checkpoint's KV cache scale, one value (per tensor) or one per kv head (compressed-tensors' attn_head
        strategy, [kv_heads, 1, 1]): which is "k", "v" or "kv" (one scale for both, older files)."""
        heads = self.checkpoint_kv_heads
        if loaded.numel() not in (1, heads) or not loaded.is_floating_point():
            raise ValueError(f"a KV cache scale must be floating-point, one value (per tensor) or one per kv head "
                             f"({heads}), got {loaded.dtype} {tuple(loaded.shape)}")
        values = loaded.reshape(-1).tolist()
        bad = [s for s in values if not 0 < s < float("inf")]
        if bad:
            raise ValueError(f"KV cache scale {bad[0]} must be positive and finite")
        value = values[0] if len(values) == 1 else tuple(values[self.first_kv_head:
                                                                 self.first_kv_head + self.num_kv_heads])
        k, v = self.kv_scales or (None, None)
        self.kv_scales = (value if which in ("k", "kv") else k, value if which in ("v", "kv") else v)

    def _decode_kernel(self, q, cache: PagedKVCache, d: DecodeGroup):
        out = q.new_empty(q.shape)
        i = self.layer_idx
        self._ops.paged_decode_attention(out, q, cache.k[i], cache.v[i], d.block_tables, d.context_lens, self.scale,
                                         cache.k_scales[i], cache.v_scales[i])
        return out

    def _decode_sdpa(self, q, cache: PagedKVCache, d: DecodeGroup):
        keys, values = cache.gather(self.layer_idx, d.block_tables, d.context_len, q.dtype)  # [B, kv_heads, S, d]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=d.mask, scale=self.scale,
                                             enable_gqa=True)  # [B, heads, 1, d]
        return out.squeeze(2)

    def _prefill(self, q, k, v, cache: PagedKVCache, span: PrefillSpan, out: torch.Tensor) -> None:
        """The span's attention into out [n, heads, head_dim] (its rows of the layer's output)."""
        n = span.end - span.start
        if self._bf16_prefill:
            i = self.layer_idx
            if span.block_table is None:
                self._ops.prefill_attention(out, q[span.start:span.end], k[span.start:span.end],
                                            v[span.start:span.end], self.scale)
                return
            if cache.k[i].dtype == torch.bfloat16:  # not a cache of int8 / fp8 codes
                self._ops.prefill_attention_paged(out, q[span.start:span.end], cache.k[i], cache.v[i],
                                                  span.block_table.reshape(-1), span.context_len, self.scale)
                return
        query = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if span.block_table is None:
            keys = k[span.start:span.end].transpose(0, 1).unsqueeze(0)
            values = v[span.start:span.end].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(query, keys, values, is_causal=n > 1, scale=self.scale,
                                                      enable_gqa=True)
        else:
            keys, values = (x.unsqueeze(0) for x in cache.gather(self.layer_idx, span.block_table,
                                                                  span.context_len, q.dtype))
            past = span.context_len - n  # query i sits at position past + i and sees keys 0..past + i
            mask = torch.ones(n, span.context_len, dtype=torch.bool, device=q.device).tril(diagonal=past)
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scale,
                                                      enable_gqa=True)
        out.copy_(attended.squeeze(0).transpose(0, 1))

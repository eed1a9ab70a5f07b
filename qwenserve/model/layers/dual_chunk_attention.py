"""Dual-chunk attention (DCA, as Qwen's 1M-token checkpoints run it): its rotary embedding and its attention over
the paged KV cache.

A sequence is cut into chunks of L = chunk_size - local_size tokens. Every key is rotated at its position within
its chunk (p mod L) and stored so in the cache. A query at position i (chunk c = i // L) is rotated three ways and
sees three kinds of keys:
- intra: keys of its own chunk (causally), the query rotated at i mod L, so distances are the true ones;
- successive: every key of chunk c - 1, the query rotated at min(i mod L + L, chunk_size);
- inter: every key of the chunks before c - 1, the query rotated at min(2L - 1, chunk_size).
No query-key distance exceeds chunk_size. The three parts are one softmax over all the keys, computed as three
attentions whose outputs merge by their log-sum-exp. With original_max_position_embeddings set, the logits of a
sequence longer than it are multiplied by a temperature t(n) = 0.1 ln(n / original) + 1 of the query's and of the
key's: vLLM scales each key by t(its sequence's length when written) and each query by t(its length now); here a
key's factor is recomputed from its position and the sequence's prompt length (t(max(prompt, j + 1))), the same
numbers, so the cache holds plain rotated keys and a block shared through the prefix cache means the same to
every sequence.

A prompt span's attentions are torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`: blocked,
with its log-sum-exp), or elsewhere a blocked PyTorch loop: no [T, T] score matrix is made. A decode token's three
parts are three score rows side by side under one softmax (the same merge, in one pass). A sequence no longer than
one chunk, below the temperature's threshold, is ordinary attention and takes the ordinary path (the parent's).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qwenserve.config.dual_chunk_config import DualChunkConfig
from qwenserve.model.layers.attention import Attention, AttentionMetadata, DecodeGroup, PagedKVCache, PrefillSpan
from qwenserve.model.layers.rotary import RotaryEmbedding, _rotate

# the blocked PyTorch path's query and key rows per block: a [heads, 256, 1024] float32 score block
_QUERY_BLOCK, _KEY_BLOCK = 256, 1024


@dataclass
class DualChunkQueries:
    """One step's queries [T, heads, head_dim], rotated for each part. succ and inter are None when no token
    of the step lies past the first chunk (then only intra attention exists)."""
    intra: torch.Tensor
    succ: torch.Tensor | None
    inter: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.intra.shape


class DualChunkRotaryEmbedding(RotaryEmbedding):
    """Plain RoPE (no scaling) over positions 0..chunk_size, applied at DCA's remapped positions: keys and intra
    queries at p mod L (the parent's rotation, its kernel included, so a sequence within one chunk is rotated to
    the bit as without DCA), successive and inter queries at their own positions."""

    def __init__(self, head_dim: int, base: float, dca: DualChunkConfig):
        super().__init__(head_dim, dca.chunk_size + 1, base, dca.chunk_size + 1, None)
        self.dca = dca

    def rotate_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int):
        """-> (DualChunkQueries, k [T, kv_heads, d], v [T, kv_heads, d])."""
        t, d = qkv.shape[0], self.head_dim
        chunk_len, chunk_size = self.dca.chunk_len, self.dca.chunk_size
        within = positions % chunk_len
        succ = inter = None
        if t and int(positions.max()) >= chunk_len:
            # from the unrotated queries, before the parent rotates them in place
            q = qkv[:, :num_heads * d].view(t, num_heads, d)
            succ = self._rotate_at(q, (within + chunk_len).clamp(max=chunk_size))
            inter = self._rotate_at(q, torch.full_like(within, min(2 * chunk_len - 1, chunk_size)))
        q, k, v = super().rotate_qkv(within, qkv, num_heads, num_kv_heads)
        return DualChunkQueries(q, succ, inter), k, v

    def _rotate_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
        return _rotate(x, cos, sin)


class DualChunkAttention(Attention):
    """One layer's attention under DCA. Writes the step's K/V as the parent does, then runs each decode token and
    each prompt span as one sequence: DCA where the sequence reaches past one chunk (or past the temperature's
    threshold), the parent's ordinary attention otherwise."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dca: DualChunkConfig, kv_heads: tuple[int, int] | None = None):
        super().__init__(layer_idx, num_heads, num_kv_heads, head_dim, scale, kv_heads)
        self.dca = dca
        self._flash = None
        if torch.empty(0).device.type == "cpu":
            self._flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

    def forward(self, q: DualChunkQueries, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata):
        md = attn_metadata
        cache = md.kv_cache
        cache.write(self.layer_idx, md.slot_mapping, k, v, self.kv_scales)
        out = torch.empty_like(q.intra)
        for d in md.decode:
            rows = d.token_index if d.token_index is not None else slice(None)
            out[rows] = self._decode_group(q, rows, cache, d)
        for span in md.prefills:
            self._prefill_span(q, k, v, cache, span, out[span.start:span.end])
        return out.reshape(q.intra.shape[0], -1)

    # ---- which sequences need DCA ---------------------------------------------------------------------------

    def _ordinary(self, length: int, prompt_len: int) -> bool:
        """Whether a sequence of `length` tokens (so far) is ordinary attention: within one chunk and with no
        temperature."""
        return length <= self.dca.chunk_len and self.dca.temperature(max(length, prompt_len)) == 1.0

    def _decode_group(self, q: DualChunkQueries, rows, cache: PagedKVCache, d: DecodeGroup) -> torch.Tensor:
        lens, prompts = d.seq_lens, d.prompt_lens or (0,) * len(d.seq_lens)
        if len(lens) != d.block_tables.shape[0]:
            raise ValueError("dual-chunk attention reads each decode sequence's length from DecodeGroup.seq_lens, "
                             "which this group lacks")
        if all(self._ordinary(n, p) for n, p in zip(lens, prompts)):
            return self._decode(q.intra[rows], cache, d)
        out = []
        for i, (n, prompt_len) in enumerate(zip(lens, prompts)):
            row = int(rows[i]) if isinstance(rows, torch.Tensor) else i
            table = d.block_tables[i:i + 1]
            keys, values = (x.squeeze(0) for x in cache.gather(self.layer_idx, table, n, q.intra.dtype))
            one = DualChunkQueries(*(None if x is None else x[row] for x in (q.intra, q.succ, q.inter)))
            out.append(self._decode_one(one, keys, values, n, prompt_len))
        return torch.stack(out)

    def _prefill_span(self, q: DualChunkQueries, k, v, cache: PagedKVCache, span: PrefillSpan,
                      out: torch.Tensor) -> None:
        if self._ordinary(span.context_len, span.prompt_len):
            self._prefill(q.intra, k, v, cache, span, out)
            return
        rows = slice(span.start, span.end)
        if span.block_table is None:  # no cached context: this step's keys are all there is
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            keys, values = (x.squeeze(0) for x in cache.gather(self.layer_idx, span.block_table.unsqueeze(0),
                                                                 span.context_len, q.intra.dtype))
        part = DualChunkQueries(*(None if x is None else x[rows] for x in (q.intra, q.succ, q.inter)))
        out.copy_(self._dual_chunk(part, keys, values, span.context_len, span.prompt_len))

    # ---- one sequence --------------------------------------------------------------------------------------

    def _dual_chunk(self, q: DualChunkQueries, keys: torch.Tensor, values: torch.Tensor, length: int,
                    prompt_len: int) -> torch.Tensor:
        """q: the last n positions' queries [n, heads, d] of a sequence `length` tokens long; keys / values
        [kv_heads, length, d] (rotated at p mod L) -> [n, heads, d]."""
        n, chunk_len = q.intra.shape[0], self.dca.chunk_len
        first = length - n  # position of the first query
        parts = [q.intra, q.succ, q.inter]
        scales = self._temperatures(first, length, prompt_len, keys.device)
        if scales is not None:  # the key and query factors (1 within the prompt's threshold)
            q_scale, k_scale = scales
            parts = [None if x is None else x * q_scale.to(x.dtype).view(-1, 1, 1) for x in parts]
            keys = keys * k_scale.to(keys.dtype).view(1, -1, 1)
        intra, succ, inter = (None if x is None else x.transpose(0, 1) for x in parts)  # [heads, n, d]
        out = q.intra.new_empty(q.intra.shape[1], n, q.intra.shape[2])
        for c in range(first // chunk_len, (length - 1) // chunk_len + 1):
            chunk_start = c * chunk_len
            lo, hi = max(first, chunk_start), min(length, chunk_start + chunk_len)  # query positions in chunk c
            rows = slice(lo - first, hi - first)
            pieces = []  # (queries, key range, causal)
            if c >= 2:
                pieces.append((inter[:, rows], 0, chunk_start - chunk_len, False))
            if c >= 1:
                pieces.append((succ[:, rows], chunk_start - chunk_len, chunk_start, False))
            if lo > chunk_start:  # this chunk's keys before the step's first query of it
                pieces.append((intra[:, rows], chunk_start, lo, False))
            pieces.append((intra[:, rows], lo, hi, True))  # the queries' own keys: query i sees keys lo..i
            results = [self._attend(qs, keys[:, a:b], values[:, a:b], causal) for qs, a, b, causal in pieces]
            out[:, rows] = merge_by_lse(results)
        return out.transpose(0, 1)

    def _decode_one(self, q: DualChunkQueries, keys: torch.Tensor, values: torch.Tensor, length: int,
                    prompt_len: int) -> torch.Tensor:
        """The last position's query of a sequence `length` tokens long (each part [heads, d]) against its keys /
        values [kv_heads, length, d] -> [heads, d]. The parts' key ranges lie in position order (inter, successive,
        intra), so their scores side by side make one row over all the keys and one softmax over it: the
        log-sum-exp merge, in one pass, with no work past the scores of one query."""
        chunk_len = self.dca.chunk_len
        kv_heads, _, d = keys.shape
        heads = q.intra.shape[0]
        c = (length - 1) // chunk_len
        bounds = [0, max(c - 1, 0) * chunk_len, c * chunk_len, length]  # inter | successive | intra
        scales = self._temperatures(length - 1, length, prompt_len, keys.device)
        q_factor = self.scale * (float(scales[0][0]) if scales is not None else 1.0)
        # float32 scores, as the flash kernel accumulates; one copy that also makes each kv head's rows
        # contiguous (the gathered keys are a transposed view), which the matmuls below need to be fast
        keys = keys.to(torch.float32, memory_format=torch.contiguous_format)
        scores = []
        for part, lo, hi in zip((q.inter, q.succ, q.intra), bounds[:-1], bounds[1:]):
            if hi > lo:
                grouped = part.float().reshape(kv_heads, heads // kv_heads, d) * q_factor
                scores.append(grouped @ keys[:, lo:hi].transpose(1, 2))  # [kv_heads, group, keys]
        scores = torch.cat(scores, dim=-1)
        if scales is not None:
            scores = scores * scales[1]
        probs = torch.softmax(scores, dim=-1)
        values = values.to(torch.float32, memory_format=torch.contiguous_format)
        return (probs @ values).view(heads, d).to(q.intra.dtype)

    def _temperatures(self, first: int, length: int, prompt_len: int, device):
        """(factor of each query position first..length-1, factor of each key 0..length-1), or None when all are
        1: t(max(prompt_len, position + 1))."""
        if self.dca.temperature(max(length, prompt_len)) == 1.0:
            return None
        return _temperatures(first, length, prompt_len, self.dca.original_max_position_embeddings, device)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
        """q [heads, n, d], k / v [kv_heads, m, d] -> (output [heads, n, d], log-sum-exp [heads, n] float32);
        causal: query i sees keys 0..i (n == m)."""
        if self._flash is not None:
            out, lse = self._flash(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, scale=self.scale)
            return out.squeeze(0), lse.squeeze(0)
        return blocked_attention(q, k, v, self.scale, causal)


@functools.lru_cache(maxsize=32)
def _temperatures(first: int, length: int, prompt_len: int, original: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """DualChunkAttention._temperatures' tensors, made once per step for all the layers (read, never written)."""
    lengths = torch.arange(1, length + 1, dtype=torch.float64, device=device).clamp(min=prompt_len)
    factor = (0.1 * torch.log(lengths / original) + 1.0).clamp(min=1.0)
    return factor[first:].float(), factor.float()


def merge_by_lse(results: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attentions of the same queries over disjoint key sets -> the attention over their union: each output
    weighted by exp(its log-sum-exp - the union's)."""
    if len(results) == 1:
        return results[0][0]
    lse = torch.stack([r[1] for r in results])  # [parts, heads, n]
    weights = torch.softmax(lse, dim=0)
    out = sum(r[0].float() * w.unsqueeze(-1) for r, w in zip(results, weights))
    return out.to(results[0][0].dtype)


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """The flash kernel's contract in PyTorch, for devices without it: blocks of queries against blocks of keys,
    merged by a running log-sum-exp, so the scores held at once are one [heads, block, block] tile."""
    heads, n, d = q.shape
    group = heads // k.shape[0]
    k, v = k.repeat_interleave(group, 0).float(), v.repeat_interleave(group, 0).float()
    out = q.new_empty(heads, n, d)
    lse_all = q.new_empty(heads, n, dtype=torch.float32)
    for qa in range(0, n, _QUERY_BLOCK):
        qb = min(n, qa + _QUERY_BLOCK)
        qs = q[:, qa:qb].float() * scale
        # running max, sum of exponentials and weighted values; the first key block holds key 0, which every
        # query sees, so the running max is finite from then on
        top = total = acc = None
        for ka in range(0, qb if causal else k.shape[1], _KEY_BLOCK):
            kb = min(qb if causal else k.shape[1], ka + _KEY_BLOCK)
            s = qs @ k[:, ka:kb].transpose(1, 2)
            if causal and kb > qa:
                visible = torch.arange(qa, qb, device=q.device)[:, None] >= torch.arange(ka, kb, device=q.device)
                s = s.masked_fill(~visible, float("-inf"))
            new_top = s.amax(-1) if top is None else torch.maximum(top, s.amax(-1))
            p = torch.exp(s - new_top.unsqueeze(-1))
            if top is None:
                total, acc = p.sum(-1), p @ v[:, ka:kb]
            else:
                shrink = torch.exp(top - new_top)
                total = total * shrink + p.sum(-1)
                acc = acc * shrink.unsqueeze(-1) + p @ v[:, ka:kb]
            top = new_top
        out[:, qa:qb] = (acc / total.unsqueeze(-1)).to(q.dtype)
        lse_all[:, qa:qb] = top + torch.log(total)
    return out, lse_all

"""The LoRA products in PyTorch ops, punica's scheme: per group of tokens that share an adapter, shrink (x A^T:
[tokens, in] -> [tokens, rank]) then expand (B^T into the output columns each adapted slice owns).

Grouped by adapter (sgmv), not gathered per token (bgmv): on the CPU one matmul per adapter in the batch reads
each adapter's weights once, where a per-token gather would copy them for every token."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qwenserve.lora.batch import LoRABatch


@dataclass
class Expand:
    """One adapted slice of a layer's output (q, k or v of a fused qkv; gate or up; or the whole output)."""
    out_offset: int  # first output column of the slice in this rank's output
    rank_start: int  # the slice's columns of the shrunk activations
    rank_end: int
    b_t: torch.Tensor  # [rank, slice width]: B^T, scaled by the adapter's scaling


@dataclass
class LayerAdapter:
    """One adapter's weights for one (possibly fused) layer: the A matrices of its adapted slices stacked, so a
    single shrink serves them all."""
    a_t: torch.Tensor  # [in, sum of the slices' ranks]
    expands: list[Expand]


def add_lora(y: torch.Tensor, x: torch.Tensor, batch: LoRABatch, slots: list[LayerAdapter | None]) -> None:
    """y [T, out] += each token's adapter product on x [T, in], in place. Slots whose adapter leaves this layer
    alone (None) add nothing."""
    for slot, rows in batch.groups:
        adapter = slots[slot]
        if adapter is None:
            continue
        if isinstance(rows, slice):
            shrunk = x[rows] @ adapter.a_t
            for e in adapter.expands:
                out = y[rows, e.out_offset:e.out_offset + e.b_t.shape[1]]
                out.addmm_(shrunk[:, e.rank_start:e.rank_end], e.b_t)
        else:
            shrunk = x.index_select(0, rows) @ adapter.a_t
            for e in adapter.expands:
                out = y[:, e.out_offset:e.out_offset + e.b_t.shape[1]]
                out.index_add_(0, rows, shrunk[:, e.rank_start:e.rank_end] @ e.b_t)

"""The LoRA products in PyTorch ops, punica's scheme: shrink (x A^T: [tokens, in] -> [tokens, rank]) then expand
(B^T into the output columns each adapted slice owns).

Two ways, one result:
- by groups (sgmv): per adapter, one shrink and its expands over the rows that run with it. One matmul per adapter
  reads its weights once, where a per-token gather (bgmv) would copy them for every token. Steps with long prompt
  chunks run this way.
- stacked: every filled slot's weights in one [slots, ...] tensor. On the CPU one kernel call (lora_add in
  kernels/cpu/lora.cpp) reads each slot's weights once, in the run dtype, for all of its rows; elsewhere each
  slot's rows are gathered into a [slots, rows, in] batch (padded to the busiest slot's rows) for one batched
  shrink and one batched expand, and the real rows added back. A decode step of eight adapters spends its time
  between small matmuls otherwise.
By groups, on the CPU, the adapters' weights and products are float32 whatever the run dtype: PyTorch's float32
matmuls at these shapes (a rank of 8-64 on one side) beat its bfloat16 ones, for twice the memory (docs/lora.md)."""
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


@dataclass
class StackedAdapters:
    """The adapters of some slots for one layer, stacked: a [slots, C, in] (each adapter's A, one row per shrunk
    column) and b [slots, C, out] (its scaled B^T at its output columns), C the widest slot's shrunk columns
    (narrower ones and a slot whose adapter leaves this layer alone are zeros). With the CPU kernel library (ops)
    they are in the run dtype and its lora_add runs them; else float32 for PyTorch's batched matmuls."""
    slots: tuple[int, ...]
    a: torch.Tensor
    b: torch.Tensor
    ops: object | None

    @classmethod
    def of(cls, slots: list[LayerAdapter | None], stack: tuple[int, ...], in_features: int, out_features: int,
           dtype: torch.dtype, device: torch.device, ops=None) -> StackedAdapters:
        columns = max((slots[s].a_t.shape[1] for s in stack if slots[s] is not None), default=1)
        a = torch.zeros(len(stack), columns, in_features, dtype=dtype, device=device)
        b = torch.zeros(len(stack), columns, out_features, dtype=dtype, device=device)
        for i, slot in enumerate(stack):
            adapter = slots[slot]
            if adapter is None:
                continue
            a[i, :adapter.a_t.shape[1]] = adapter.a_t.t()
            for e in adapter.expands:
                b[i, e.rank_start:e.rank_end, e.out_offset:e.out_offset + e.b_t.shape[1]] = e.b_t
        return cls(stack, a, b, ops)


def add_lora(y: torch.Tensor, x: torch.Tensor, batch: LoRABatch, slots: list[LayerAdapter | None],
             stacked: StackedAdapters | None = None) -> None:
    """y [T, out] += each token's adapter product on x [T, in], in place. Slots whose adapter leaves this layer
    alone (None) add nothing. stacked: these slots stacked as batch.stacked orders them, when it is set."""
    rows = batch.stacked
    if rows is not None:
        if stacked.ops is not None:
            stacked.ops.lora_add(y, x.contiguous(), stacked.a, stacked.b, rows.positions)
            return
        xs = x.index_select(0, rows.gather).to(stacked.a.dtype).view(len(rows.slots), -1, x.shape[1])
        products = torch.bmm(torch.bmm(xs, stacked.a.transpose(1, 2)), stacked.b).flatten(0, 1)
        y.index_add_(0, rows.targets, products.index_select(0, rows.real).to(y.dtype))
        return
    for slot, group in batch.groups:
        adapter = slots[slot]
        if adapter is None:
            continue
        dtype = adapter.a_t.dtype
        if isinstance(group, slice):
            shrunk = x[group].to(dtype) @ adapter.a_t
            for e in adapter.expands:
                # float32 products added into a bfloat16 output round once, in place
                y[group, e.out_offset:e.out_offset + e.b_t.shape[1]].add_(shrunk[:, e.rank_start:e.rank_end] @ e.b_t)
        else:
            shrunk = x.index_select(0, group).to(dtype) @ adapter.a_t
            for e in adapter.expands:
                out = y[:, e.out_offset:e.out_offset + e.b_t.shape[1]]
                out.index_add_(0, group, (shrunk[:, e.rank_start:e.rank_end] @ e.b_t).to(y.dtype))

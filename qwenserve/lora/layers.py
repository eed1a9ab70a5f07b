"""A linear layer with adapters: the base layer as it is, plus, for the tokens of a step that run with an
adapter, that adapter's product (ops.add_lora). The adapters' weights are sliced here as the base layer slices
its own: B's rows by the layer's output shards (column-parallel), A's columns by its input shard (row-parallel)."""
from __future__ import annotations

import torch
from torch import nn

from qwenserve.kernels import cpu_ops_for
from qwenserve.lora.batch import LoRABatch
from qwenserve.lora.ops import Expand, LayerAdapter, StackedAdapters, add_lora
from qwenserve.model.layers.linear import RowParallelLinear


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, max_loras: int):
        """base: a layer of model/layers/linear.py (its output_shard / input_shard say what this rank holds)."""
        super().__init__()
        self.base = base
        # the adapter in each slot of the batch (None: the slot is free, or its adapter leaves this layer alone)
        self.slots: list[LayerAdapter | None] = [None] * max_loras
        # the slots stacked for the steps that run stacked: made at the first such step after the slots change
        self._stacked: StackedAdapters | None = None
        self._reduces = isinstance(base, RowParallelLinear)
        self._ops = cpu_ops_for(torch.empty(0).device)  # the device the model is built on: its stacked kernel

    def set_slot(self, slot: int, adapter: LayerAdapter | None) -> None:
        self.slots[slot] = adapter
        self._stacked = None

    def _add_lora(self, y: torch.Tensor, x: torch.Tensor, lora: LoRABatch) -> None:
        rows = lora.stacked
        if rows is not None and (self._stacked is None or self._stacked.slots != rows.slots):
            example = next(a.a_t for a in self.slots if a is not None) if any(self.slots) else None
            if example is None:
                return  # no adapter in any slot touches this layer
            self._stacked = StackedAdapters.of(self.slots, rows.slots, x.shape[1], y.shape[1],
                                               x.dtype if self._ops is not None else example.dtype, example.device,
                                               self._ops)
        add_lora(y, x, lora, self.slots, self._stacked)

    def prepare(self, parts: dict, scaling: float, dtype: torch.dtype, device: torch.device) -> LayerAdapter | None:
        """One adapter's weights for this layer: parts maps each adapted shard id (q, k, v; 0, 1; None for an
        unfused layer) to its checkpoint (A [r, in], B [out, r]) of the whole model; this rank's slices, scaled,
        in the run dtype."""
        if not parts:
            return None
        first_col, num_cols = self.base.input_shard()
        a_parts, expands, rank_end = [], [], 0
        for shard_id, (a, b) in parts.items():
            offset, size, start = self.base.output_shard(shard_id)
            r = a.shape[0]
            a_parts.append(a.narrow(1, first_col, num_cols))
            b_t = (b.narrow(0, start, size).float() * scaling).t()
            expands.append(Expand(offset, rank_end, rank_end + r, b_t.to(dtype=dtype, device=device).contiguous()))
            rank_end += r
        a_t = torch.cat(a_parts).t().to(dtype=dtype, device=device).contiguous()
        return LayerAdapter(a_t, expands)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if lora is None:
            return self.base(x)
        if not self._reduces:
            y = self.base(x)
            self._add_lora(y, x, lora)
            return y
        # row-parallel: the adapter's product on this rank's input columns is a partial sum like the base's, so it
        # joins the same all-reduce; the bias is added once, after it
        base = self.base
        y = base.linear_method.apply(base, x, None)
        self._add_lora(y, x, lora)
        y = base.tp.all_reduce(y)
        return y + base.bias if base.bias is not None else y

"""A 2-D weight kept in ggml's block format, as a GGUF file stores it: each row is a run of blocks (32 or
256 weights each, with their scales), so rows can be taken apart without decoding anything. Once loaded, a
layer may hold it in the decode layout instead (`grouped`: the same bytes, ordered for the decode kernel)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qwenserve.model.loader.dequant import dequantize

DECODE_GROUP = 8  # rows per group in the decode layout (kernels/cpu/ggml/common.h, Layout)


@dataclass(frozen=True)
class GGMLTensor:
    raw: torch.Tensor  # uint8 [rows, row_bytes]
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]  # (rows, cols) in weights
    # 1: the file's layout, row after row. DECODE_GROUP: rows in groups with block b of every row of a group side
    # by side (the same bytes), which the decode kernel reads as one stream; only our kernels read it.
    group: int = 1

    @classmethod
    def from_bytes(cls, raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> GGMLTensor:
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        return cls(raw.view(rows, -1), ggml_type, (rows, cols))

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def grouped(self) -> GGMLTensor:
        """The decode layout (see `group`); the file's layout when the rows do not divide into groups."""
        if self.group != 1 or self.shape[0] % DECODE_GROUP:
            return self
        return self._regrouped(DECODE_GROUP)

    def in_file_layout(self) -> GGMLTensor:
        return self if self.group == 1 else self._regrouped(1)

    def _regrouped(self, group: int) -> GGMLTensor:
        """The same blocks in the other layout: within each group of rows, [rows, blocks] becomes [blocks, rows]
        (file -> decode layout) or back."""
        size = max(group, self.group)  # the group the rows come in
        rows, cols = self.shape
        bs, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        inner = (size, cols // bs) if self.group == 1 else (cols // bs, size)
        # each block moves as one numpy item of block_bytes: torch copies a transposed uint8 tensor byte by byte
        # (0.1-0.3 GB/s, minutes for a MoE file's experts), numpy moves whole items (0.6-8 GB/s)
        blocks = self.raw.contiguous().numpy().view(np.dtype((np.void, block_bytes))).reshape(rows // size, *inner)
        raw = torch.from_numpy(np.ascontiguousarray(blocks.transpose(0, 2, 1)).view(np.uint8)).view(rows, -1)
        return GGMLTensor(raw, self.ggml_type, self.shape, group)

    def take_rows(self, ids: torch.Tensor) -> GGMLTensor:
        """Rows `ids` (any order, repeats allowed) in the file's layout, from either layout, without decoding: an
        embedding lookup in the blocks a tied LM head holds in the decode layout."""
        ids = ids.reshape(-1)
        if self.group == 1:
            return GGMLTensor(self.raw.index_select(0, ids), self.ggml_type, (ids.numel(), self.shape[1]))
        rows, cols = self.shape
        bs, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        groups = self.raw.view(rows // self.group, cols // bs, self.group, block_bytes)
        raw = groups[ids // self.group, :, ids % self.group]  # [ids, blocks, block bytes]
        return GGMLTensor(raw.reshape(ids.numel(), -1), self.ggml_type, (ids.numel(), cols))

    def narrow(self, dim: int, start: int, length: int) -> GGMLTensor:
        """Rows (dim 0) freely; columns (dim 1) only on block boundaries."""
        if self.group != 1:
            return self.in_file_layout().narrow(dim, start, length)
        rows, cols = self.shape
        if dim == 0:
            return GGMLTensor(self.raw.narrow(0, start, length), self.ggml_type, (length, cols))
        if start == 0 and length == cols:
            return self
        bs, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        if start % bs or length % bs:
            raise ValueError(f"cannot split a {self.ggml_type.name} tensor's columns at {start}:{start + length}: "
                             f"its blocks hold {bs} weights")
        raw = self.raw.narrow(1, start // bs * block_bytes, length // bs * block_bytes).contiguous()
        return GGMLTensor(raw, self.ggml_type, (rows, length))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.group != 1:
            return self.in_file_layout().dequantize(dtype)
        # the formulas run in numpy on the host; the rows return to where the blocks live (a CUDA device too)
        rows = dequantize(self.raw.reshape(-1).cpu().numpy(), self.ggml_type, self.shape)
        return rows.to(device=self.raw.device, dtype=dtype)

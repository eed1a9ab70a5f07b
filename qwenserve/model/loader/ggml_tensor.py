"""A 2-D weight kept in ggml's block format, as a GGUF file stores it: each row is a run of blocks (32 or
256 weights each, with their scales), so rows can be taken apart without decoding anything."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qwenserve.model.loader.dequant import dequantize


@dataclass(frozen=True)
class GGMLTensor:
    raw: torch.Tensor  # uint8 [rows, row_bytes]
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]  # (rows, cols) in weights

    @classmethod
    def from_bytes(cls, raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> GGMLTensor:
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        return cls(raw.view(rows, -1), ggml_type, (rows, cols))

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def narrow(self, dim: int, start: int, length: int) -> GGMLTensor:
        """Rows (dim 0) freely; columns (dim 1) only on block boundaries."""
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
        return dequantize(self.raw.reshape(-1).numpy(), self.ggml_type, self.shape).to(dtype)

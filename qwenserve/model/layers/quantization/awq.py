"""AWQ checkpoints as AutoAWQ writes them (version "gemm", the layout of Qwen2.5-*-AWQ):
  qweight int32 [in, out / 8]: eight 4-bit codes per word along the outputs, interleaved: the word's nibble i
          (lowest first) holds output column AWQ_ORDER[i] of its eight;
  qzeros  int32 [in / group, out / 8], packed the same way;
  scales  fp16  [in / group, out];
  weight[n, k] = (q[k, n] - zero[k / group, n]) * scale[k / group, n]."""
from __future__ import annotations

import torch

from qwenserve.model.layers.quantization.group_quantized import GroupQuantizedLinearMethod, unpack_int32

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


class AWQLinearMethod(GroupQuantizedLinearMethod):
    name = "awq"

    @classmethod
    def from_config(cls, config: dict) -> AWQLinearMethod:
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported (gemm, AutoAWQ's default, is)")
        if not config.get("zero_point", True):
            raise ValueError("awq without zero points (zero_point: false) is not supported")
        return cls(int(config.get("bits", config.get("w_bit", 4))),
                   int(config.get("group_size", config.get("q_group_size", 128))))

    def __init__(self, bits: int, group_size: int):
        if bits != 4:
            raise ValueError(f"awq: {bits}-bit weights are not supported (AWQ checkpoints are 4-bit)")
        super().__init__(bits, group_size)

    def unpack(self, parts: dict[str, torch.Tensor]):
        codes = unpack_int32(parts["qweight"], 4, dim=1, order=AWQ_ORDER).t()
        zeros = unpack_int32(parts["qzeros"], 4, dim=1, order=AWQ_ORDER).t().float()
        scales = parts["scales"].t().float()
        group = self.check_groups(codes, scales, zeros)
        return codes, scales, zeros, torch.arange(codes.shape[1]) // group

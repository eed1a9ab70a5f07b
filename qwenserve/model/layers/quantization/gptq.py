"""GPTQ checkpoints as AutoGPTQ / GPTQModel write them (the layout of Qwen2.5-*-GPTQ-Int4 and -Int8):
  qweight int32 [in * bits / 32, out]: 32 / bits codes per word along the inputs, lowest bits first;
  qzeros  int32 [groups, out * bits / 32]: along the outputs, lowest bits first, each stored minus one
          (format "gptq", v1; "gptq_v2" stores the zeros themselves);
  scales  fp16  [groups, out];
  g_idx   int32 [in]: the group of each input feature (k / group, or scattered with act-order, desc_act);
  weight[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]."""
from __future__ import annotations

import torch

from qwenserve.model.layers.quantization.group_quantized import GroupQuantizedLinearMethod, unpack_int32


class GPTQLinearMethod(GroupQuantizedLinearMethod):
    PARTS = ("qweight", "qzeros", "scales", "g_idx")
    name = "gptq"

    @classmethod
    def from_config(cls, config: dict) -> GPTQLinearMethod:
        return cls(int(config.get("bits", 4)), int(config.get("group_size", 128)),
                   zeros_minus_one=str(config.get("checkpoint_format", "gptq")).lower() != "gptq_v2")

    def __init__(self, bits: int, group_size: int, zeros_minus_one: bool = True):
        super().__init__(bits, group_size)
        self.zeros_minus_one = zeros_minus_one

    def unpack(self, parts: dict[str, torch.Tensor]):
        mask = (1 << self.bits) - 1
        codes = unpack_int32(parts["qweight"], self.bits, dim=0).t()
        zeros = unpack_int32(parts["qzeros"], self.bits, dim=1)
        zeros = ((zeros + 1) & mask if self.zeros_minus_one else zeros).t().float()
        scales = parts["scales"].t().float()
        groups = parts["g_idx"].long()
        if groups.shape[0] != codes.shape[1]:
            raise ValueError(f"gptq g_idx has {groups.shape[0]} entries, qweight {codes.shape[1]} inputs")
        if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= scales.shape[1]):
            raise ValueError(f"gptq g_idx holds groups {int(groups.min())}..{int(groups.max())}, scales "
                             f"{scales.shape[1]}")
        if scales.shape != zeros.shape or scales.shape[0] != codes.shape[0]:
            raise ValueError(f"gptq scales {tuple(parts['scales'].shape)} and qzeros (unpacked "
                             f"{tuple(zeros.t().shape)}) do not match qweight's {codes.shape[0]} outputs")
        return codes, scales, zeros, groups

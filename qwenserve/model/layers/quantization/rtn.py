"""`int8` and `int4`: weight-only quantization of a dense checkpoint at load, by rounding to nearest.

- int8: symmetric, one scale per output channel (weight = d * q, q in -127..127, d = amax / 127).
- int4: asymmetric, one scale and offset per group of 128 input features (weight = d * q + m, q in 0..15,
  d = (max - min) / 15, m = min), the form of ggml's Q4_1 and of AWQ / GPTQ's zero points.

The codes are written as ggml blocks (Q8_0 with each block repeating its channel's scale: 8.5 bits per weight;
Q4_1 with each block repeating its group's scale and offset: 5 bits per weight) so that the kernels the GGUF
path uses run them: measured on this project's 2-core AVX2 machine at M=1 (N=9728, K=896), ggml_mm on Q8_0
took 0.40 ms against 1.84 ms for torch's `_weight_int8pack_mm`, and Q4_0 0.47 ms against 0.95 ms for
`_weight_int4pack_mm_for_cpu`. Each layer is loaded dense in the run dtype and quantized once loading is done."""
from __future__ import annotations

import torch
from torch import nn

from qwenserve.model.layers.quantization.ggml_blocks import (
    BLOCK,
    GGMLBlockLinearMethod,
    drop_dense_weight,
    pack_q4_1,
    pack_q8_0,
)

INT4_GROUP = 128


class _RoundToNearestMethod(GGMLBlockLinearMethod):
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        self.init_layer(layer)
        self.check_shape(layer, in_features)
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def check_shape(self, layer: nn.Module, in_features: int) -> None:
        if in_features % BLOCK:
            raise ValueError(f"{type(self).__name__}: {type(layer).__name__} has {in_features} input features, "
                             f"not a multiple of the {BLOCK}-weight blocks it is stored in")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.segments = [(0, self.quantize(layer.weight.detach().float()))]
        drop_dense_weight(layer)
        super().process_weights_after_loading(layer)

    def quantize(self, weight: torch.Tensor):
        raise NotImplementedError


class Int8LinearMethod(_RoundToNearestMethod):
    def quantize(self, weight: torch.Tensor):
        d = (weight.abs().amax(1, keepdim=True) / 127).half().float()  # the scale the blocks will hold
        codes = torch.where(d > 0, weight / d, 0).round().clamp(-127, 127)
        return pack_q8_0(codes, d.expand(-1, weight.shape[1] // BLOCK))


class Int4LinearMethod(_RoundToNearestMethod):
    def check_shape(self, layer: nn.Module, in_features: int) -> None:
        if in_features % INT4_GROUP:
            raise ValueError(f"int4: {type(layer).__name__} has {in_features} input features, not a multiple of "
                             f"the quantization group of {INT4_GROUP}")

    def quantize(self, weight: torch.Tensor):
        rows, cols = weight.shape
        groups = weight.view(rows, cols // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        d, m = ((high - low) / 15).half().float(), low.half().float()
        codes = torch.where(d > 0, (groups - m) / d, 0).round().clamp(0, 15).view(rows, cols)
        per_block = INT4_GROUP // BLOCK
        return pack_q4_1(codes, d.squeeze(-1).repeat_interleave(per_block, 1),
                         m.squeeze(-1).repeat_interleave(per_block, 1))

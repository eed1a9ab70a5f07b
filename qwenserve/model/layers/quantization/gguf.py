"""The `gguf` linear method: a GGUF file's quantized blocks stay in memory as the file holds them and our CPU
kernels compute with them directly, so each decode step reads 4.5-8.5 bits per weight instead of 16.

A fused layer (qkv, gate_up) is a list of segments, one per checkpoint tensor, because the tensors it fuses
may have different types (a Q4_K_M file mixes Q5_0 q/k with Q8_0 v). How segments run: ggml_blocks.py."""
from __future__ import annotations

import functools
import logging

import torch
from gguf import GGMLQuantizationType
from torch import nn

from qwenserve.model.layers.linear import check_checkpoint_shape
from qwenserve.model.layers.quantization.ggml_blocks import BLOCK, GGMLBlockLinearMethod, quantize_q8_0
from qwenserve.model.loader.ggml_tensor import GGMLTensor

logger = logging.getLogger(__name__)
_REPORTED_SPLITS: set = set()  # (type, shape) already logged: one line, not one per layer

Q = GGMLQuantizationType
# the block types our kernels run; a GGUF file's other quantized types are dequantized at load
KERNEL_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})


class GGUFLinearMethod(GGMLBlockLinearMethod):
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        self.init_layer(layer)
        # a placeholder parameter, so the loader finds `weight` and its loader; the blocks live in layer.segments
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        layer.weight.weight_loader = functools.partial(self._load, layer)
        layer.weight.takes_ggml_blocks = True

    def _load(self, layer: nn.Module, param: nn.Parameter, loaded, shard_id=None) -> None:
        offset, size, start = layer.output_shard(shard_id)
        check_checkpoint_shape(layer, loaded, shard_id)
        segment = _columns(loaded.narrow(0, start, size), *layer.input_shard())
        if isinstance(segment, torch.Tensor):  # a float tensor in the file (F16, F32)
            segment = segment.to(layer.weight_dtype).contiguous()
        layer.segments.append((offset, segment))


def _columns(rows, start: int, length: int):
    """This rank's input columns. A row-parallel split that falls inside the tensor's blocks (a k-quant's 256
    weights: the 0.5B model's 4864-wide down_proj halves at 2432) re-quantizes this rank's part as Q8_0, with
    32-weight blocks (8.5 bits a weight, near-lossless on top of the file's own rounding)."""
    try:
        return rows.narrow(1, start, length)
    except ValueError:
        if not isinstance(rows, GGMLTensor) or start % BLOCK or length % BLOCK:
            raise
    if (rows.ggml_type, rows.shape) not in _REPORTED_SPLITS:
        _REPORTED_SPLITS.add((rows.ggml_type, rows.shape))
        logger.info("%s tensors [%d x %d] split at column %d, inside their blocks: this rank's part is re-quantized "
                    "to Q8_0", rows.ggml_type.name, *rows.shape, start)
    return quantize_q8_0(rows.dequantize().narrow(1, start, length))

"""The `gguf` linear method: a GGUF file's quantized blocks stay in memory as the file holds them and our CPU
kernels compute with them directly, so each decode step reads 4.5-8.5 bits per weight instead of 16.

A fused layer (qkv, gate_up) is a list of segments, one per checkpoint tensor, because the tensors it fuses
may have different types (a Q4_K_M file mixes Q5_0 q/k with Q8_0 v). Few rows (decode): `ggml_mm` quantizes
the activations to int8 blocks and runs integer dot products, as llama.cpp does. Many rows (prefill), where
the CPU has a fast dense matmul for the dtype: the segment is dequantized and run as a dense matmul.
Without the kernels (CUDA, no C++ compiler) the blocks are dequantized once, at load, with a warning."""
from __future__ import annotations

import functools
import logging
import sys

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from qwenserve.kernels import cpu_ops_for
from qwenserve.model.layers.linear import LinearMethod, UnquantizedLinearMethod
from qwenserve.model.loader.ggml_tensor import GGMLTensor

logger = logging.getLogger(__name__)
Q = GGMLQuantizationType
# the block types our kernels run; a GGUF file's other quantized types are dequantized at load
KERNEL_TYPES = frozenset({Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})


def dense_from_rows(dtype: torch.dtype) -> int:
    """From how many rows dequantizing a segment and running a dense matmul beats int8 dot products per row.
    Measured on a 2-core AVX2 machine (no native bf16): ggml_mm at 33 rows was 3-5x faster than a bf16 matmul
    (emulated there), about half as fast as a float32 one at large M. With native bf16 (AVX512-BF16, AMX)
    oneDNN's dense path wins from a few dozen rows."""
    if dtype == torch.float32:
        return 64
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 32
    return sys.maxsize  # emulated half-precision matmuls never pay
_DENSE = UnquantizedLinearMethod()  # what a dequantized layer runs


class GGUFLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        # a placeholder parameter, so the loader finds `weight` and its loader; the blocks live in layer.segments
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        layer.weight.weight_loader = functools.partial(self._load, layer)
        layer.weight.takes_ggml_blocks = True
        layer.segments = []  # (offset in this rank's output, GGMLTensor or dense rows in the run dtype)
        layer.weight_dtype = torch.get_default_dtype()
        layer.packed_weight = None
        layer.ggml_ops = cpu_ops_for(torch.empty(0).device)  # chosen once, where the model is built
        layer.dense_from_rows = dense_from_rows(layer.weight_dtype)

    def _load(self, layer: nn.Module, param: nn.Parameter, loaded, shard_id=None) -> None:
        offset, size, start = layer.output_shard(shard_id)
        segment = loaded.narrow(0, start, size).narrow(1, *layer.input_shard())
        if tuple(segment.shape) != (size, layer.input_size):
            raise ValueError(f"{type(layer).__name__}" + ("" if shard_id is None else f" shard {shard_id}") +
                             f": checkpoint tensor has shape {tuple(loaded.shape)}, the model expects rows "
                             f"{start}:{start + size} of {layer.input_size} columns")
        if isinstance(segment, torch.Tensor):  # a float tensor in the file (F16, F32)
            segment = segment.to(layer.weight_dtype).contiguous()
        layer.segments.append((offset, segment))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.segments.sort(key=lambda s: s[0])
        if layer.ggml_ops is not None:
            return
        _warn_dequantizing(layer.weight.device)
        weight = torch.zeros(layer.output_size, layer.input_size, dtype=layer.weight_dtype,
                             device=layer.weight.device)
        for offset, segment in layer.segments:
            rows = segment.dequantize(layer.weight_dtype) if isinstance(segment, GGMLTensor) else segment
            weight[offset:offset + rows.shape[0]] = rows
        layer.weight, layer.segments = nn.Parameter(weight, requires_grad=False), None
        _DENSE.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.segments is None:  # dequantized at load
            return _DENSE.apply(layer, x, bias)
        ops, x = layer.ggml_ops, x.contiguous()
        out = x.new_empty(x.shape[0], layer.output_size)
        dense = x.shape[0] >= layer.dense_from_rows
        for offset, segment in layer.segments:
            rows = segment.shape[0]
            if not isinstance(segment, GGMLTensor):
                out[:, offset:offset + rows] = F.linear(x, segment)
            elif dense:
                weight = ops.ggml_dequantize(segment.raw, int(segment.ggml_type), segment.shape[1], x.dtype)
                out[:, offset:offset + rows] = F.linear(x, weight)
            else:
                ops.ggml_mm(out[:, offset:offset + rows], x, segment.raw, int(segment.ggml_type))
        if bias is not None:
            out += bias
        return out


@functools.lru_cache(maxsize=None)
def _warn_dequantizing(device: torch.device) -> None:
    logger.warning("quantization gguf: our kernels do not run on %s; the quantized weights are dequantized at "
                   "load (dense memory and speed)", device)

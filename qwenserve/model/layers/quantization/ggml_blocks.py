"""Linear layers whose weight is held as ggml blocks (see kernels/cpu/ggml/), and packers that write
integer codes with their scales as such blocks.

Every quantized method here (a GGUF file's own blocks, int8 / int4 made at load, AWQ and GPTQ checkpoints) ends
up as `layer.segments`: (offset in this rank's output, GGMLTensor or dense rows) in output order, so they share
one apply: few rows (decode) run `ggml_mm` (activations quantized to int8 blocks, integer dot products, as
llama.cpp does); many rows (prefill), where the CPU has a fast dense matmul for the dtype, dequantize a segment
and run it dense. A layer may also carry `input_order`, a permutation of its input features (GPTQ's act-order
groups, made contiguous at load). Without the kernels (CUDA, no C++ compiler) the blocks are dequantized once,
at load (the loader warns)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from qwenserve.config.tuning import CPUTuning, this_cpu_tuning
from qwenserve.kernels import cpu_ops_for
from qwenserve.model.layers.linear import LinearMethod, UnquantizedLinearMethod
from qwenserve.model.loader.ggml_tensor import GGMLTensor

Q = GGMLQuantizationType
BLOCK = 32  # weights per block of the 32-block types, the ones the packers below write


def dense_route(dtype: torch.dtype, tuning: CPUTuning) -> tuple[int, torch.dtype]:
    """(from how many activation rows dequantizing a segment and running a dense matmul beats int8 dot products
    per row, the dtype that matmul runs in) for a run in `dtype`: docs/tuning.md, "Dense route"."""
    if dtype == torch.float32:
        return tuning.dense_from_rows_float32, torch.float32
    if dtype == torch.bfloat16:
        return tuning.dense_from_rows_bfloat16, tuning.dense_dtype_bfloat16
    return tuning.dense_from_rows_float16, torch.float32


K_QUANTS = {Q.Q4_K, Q.Q5_K, Q.Q6_K}


def tiles_dense_from_rows(layer: nn.Module) -> int | None:
    """From how many rows the layer should take the dense route, given ggml_mm's tile kernels (VNNI, and AMX where
    it runs: int8 for the K-quants, bf16 for the 32-blocks in bf16 runs); None where the tile kernel does not run
    every segment (or the table leaves the dense route's own threshold): docs/tuning.md, "Tiles"."""
    tiles = getattr(layer.ggml_ops, "ggml_mm_tiles", None)
    segments = [segment for _, segment in layer.segments]
    if tiles is None or not all(isinstance(s, GGMLTensor) and s.group != 1 and tiles(int(s.ggml_type))
                                for s in segments):
        return None
    tuning = layer.tuning
    if layer.dense_dtype == torch.float32:
        return tuning.tiles_dense_from_rows_float32
    if any(s.ggml_type in K_QUANTS for s in segments):
        amx = getattr(layer.ggml_ops, "ggml_amx_tiles", None)
        if tuning.amx_tiles_dense_from_rows_k_quants is not None and amx is not None and amx():
            return tuning.amx_tiles_dense_from_rows_k_quants
        return tuning.tiles_dense_from_rows_k_quants
    amx_bf16 = getattr(layer.ggml_ops, "ggml_amx_bf16_tiles", None)
    if (tuning.amx_tiles_dense_from_rows_32_blocks is not None and layer.dense_dtype == torch.bfloat16
            and amx_bf16 is not None and amx_bf16()):
        return tuning.amx_tiles_dense_from_rows_32_blocks
    return tuning.tiles_dense_from_rows_32_blocks


def activation_levels(dtype: torch.dtype, tuning: CPUTuning) -> int:
    """How many int8 codes ggml_mm gives each activation, whatever the rows: one (llama.cpp's q8_0 / q8_K) in bf16
    and fp16 runs; two in float32 runs (the second quantizes what the first left, about 15 bits in all), so that
    greedy decoding follows the exact path (quantization none) there: docs/tuning.md, "Activation codes"."""
    return tuning.activation_codes_float32 if dtype == torch.float32 else tuning.activation_codes_half


_DENSE = UnquantizedLinearMethod()  # what a dequantized layer runs


class GGMLBlockLinearMethod(LinearMethod):
    """The shared half of the block-quantized methods: subclasses create and load the weights and fill
    layer.segments (and layer.input_order) before calling this process_weights_after_loading."""

    def init_layer(self, layer: nn.Module) -> None:
        layer.segments = []  # (offset in this rank's output, GGMLTensor or dense rows in the run dtype)
        layer.input_order = None  # a permutation of the input features the segments' columns follow
        layer.weight_dtype = torch.get_default_dtype()
        layer.packed_weight = None
        layer.weight_device = torch.empty(0).device  # where the model is being built
        layer.ggml_ops = cpu_ops_for(layer.weight_device)  # chosen once, here
        layer.tuning = this_cpu_tuning()  # the row thresholds, chosen once, here
        layer.dense_from_rows, layer.dense_dtype = dense_route(layer.weight_dtype, layer.tuning)
        layer.act_levels = activation_levels(layer.weight_dtype, layer.tuning)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.segments.sort(key=lambda s: s[0])
        if layer.ggml_ops is not None:
            layer.segments = [(offset, segment.grouped() if isinstance(segment, GGMLTensor) else segment)
                              for offset, segment in _merge_adjacent(layer.segments)]
            # the decode path's ggml_mm arguments, made once (None: a segment kept dense needs the general path)
            layer.kernel_bias = getattr(layer, "bias", None)
            calls = [_kernel_call(layer, offset, segment) for offset, segment in layer.segments]
            layer.kernel_calls = None if None in calls else calls
            tile_rows = tiles_dense_from_rows(layer)
            if tile_rows is not None:
                layer.dense_from_rows = max(layer.dense_from_rows, tile_rows)
            return
        weight = torch.zeros(layer.output_size, layer.input_size, dtype=layer.weight_dtype, device=layer.weight_device)
        for offset, segment in layer.segments:
            rows = segment.dequantize(layer.weight_dtype) if isinstance(segment, GGMLTensor) else segment
            weight[offset:offset + rows.shape[0]] = rows.to(weight.device)
        if layer.input_order is not None:  # back to the checkpoint's column order
            weight[:, layer.input_order] = weight.clone()
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.segments, layer.input_order = None, None
        _DENSE.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.segments is None:  # dequantized at load
            return _DENSE.apply(layer, x, bias)
        ops = layer.ggml_ops
        x = x.contiguous() if layer.input_order is None else x.index_select(1, layer.input_order)
        out = x.new_empty(x.shape[0], layer.output_size)
        levels = layer.act_levels
        if x.shape[0] < layer.dense_from_rows and layer.kernel_calls is not None and bias is layer.kernel_bias:
            # few rows, every segment a kernel call (decode): the bias rides in the kernel, and a segment that is
            # the whole output writes it without a slice (both measurable at batch 1)
            for rows_slice, raw, ggml_type, group, segment_bias in layer.kernel_calls:
                ops.ggml_mm(out if rows_slice is None else out[:, rows_slice], x, raw, ggml_type, group, segment_bias,
                            levels)
            return out
        dense = x.shape[0] >= layer.dense_from_rows
        x_dense = x.to(layer.dense_dtype) if dense else None
        for offset, segment in layer.segments:
            rows = segment.shape[0]
            if not isinstance(segment, GGMLTensor):
                out[:, offset:offset + rows] = F.linear(x, segment)
            elif dense:
                _dense_by_slices(out[:, offset:offset + rows], x_dense, segment, ops, layer.tuning.dense_slice_weights)
            else:
                ops.ggml_mm(out[:, offset:offset + rows], x, segment.raw, int(segment.ggml_type), segment.group,
                            None, levels)
        if bias is not None:
            out += bias
        return out


def _kernel_call(layer: nn.Module, offset: int, segment) -> tuple | None:
    """(output columns, or None for all of them; raw, type, group; the float32 slice of layer.kernel_bias or None):
    one segment's ggml_mm arguments. None for a segment of dense rows (kept unquantized)."""
    if not isinstance(segment, GGMLTensor):
        return None
    rows = segment.shape[0]
    bias = layer.kernel_bias
    if bias is not None:
        bias = bias.detach()[offset:offset + rows].float().contiguous()
    whole = offset == 0 and rows == layer.output_size
    return None if whole else slice(offset, offset + rows), segment.raw, int(segment.ggml_type), segment.group, bias


def _dense_by_slices(out: torch.Tensor, x: torch.Tensor, segment: GGMLTensor, ops, slice_weights: int) -> None:
    """out = x @ dequantize(segment).T, dequantizing about slice_weights weights at a time into x's dtype: each
    slice is multiplied while it is still in cache, and the whole segment is never held dense (the LM head would
    take 545 MB in float32). Slices start on multiples of 8 rows, which keeps a decode-layout segment's groups
    whole."""
    rows, cols = segment.shape
    step = max(8, slice_weights // cols // 8 * 8)
    for start in range(0, rows, step):
        weight = ops.ggml_dequantize(segment.raw[start:start + step], int(segment.ggml_type), cols, x.dtype,
                                     segment.group)
        out[:, start:start + weight.shape[0]] = torch.mm(x, weight.t())


def _merge_adjacent(segments: list) -> list:
    """Neighbouring segments of one block type become one (q and k, gate and up, usually): one kernel call
    instead of two, which at batch 1 is a measurable part of a small layer's time."""
    merged = []
    for offset, segment in segments:
        if merged and isinstance(segment, GGMLTensor) and isinstance(merged[-1][1], GGMLTensor):
            last_offset, last = merged[-1]
            if last.ggml_type == segment.ggml_type and last_offset + last.shape[0] == offset:
                raw = torch.cat([last.raw, segment.raw])
                merged[-1] = (last_offset, GGMLTensor(raw, last.ggml_type, (raw.shape[0], last.shape[1])))
                continue
        merged.append((offset, segment))
    return merged


def drop_dense_weight(layer: nn.Module) -> None:
    """Replace the dense weight a method quantized by an empty placeholder (the memory goes back)."""
    layer.weight = nn.Parameter(torch.empty(0, device=layer.weight_device), requires_grad=False)


# ---------------------------------------------------------------------------------------------------------------
# Packers: integer codes [rows, cols] with one scale (and offset) per 32 weights -> ggml blocks (layouts at the top
# of kernels/cpu/ggml/common.h). Scales are taken as fp16, as the blocks store them.

def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """[rows, nb] -> uint8 [rows, nb, 2], little-endian fp16."""
    return values.to(torch.float16).contiguous().view(torch.uint8).view(*values.shape, 2)


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [rows, nb, 32] -> [rows, nb, 16] bytes: weight j in the low nibble of byte j, weight j+16 high."""
    codes = codes.to(torch.uint8)
    return codes[..., :16] | (codes[..., 16:] << 4)


def _blocks(rows: int, cols: int, ggml_type: Q, *fields: torch.Tensor) -> GGMLTensor:
    raw = torch.cat(fields, dim=-1).reshape(rows, -1)
    return GGMLTensor(raw, ggml_type, (rows, cols))


def pack_q8_0(codes: torch.Tensor, d: torch.Tensor) -> GGMLTensor:
    """codes int8 [rows, cols], d [rows, cols / 32]: weight = d * code."""
    rows, cols = codes.shape
    qs = codes.to(torch.int8).contiguous().view(torch.uint8).view(rows, cols // BLOCK, BLOCK)
    return _blocks(rows, cols, Q.Q8_0, _fp16_bytes(d), qs)


def quantize_q8_0(weight: torch.Tensor) -> GGMLTensor:
    """Float [rows, cols] (cols a multiple of 32) -> Q8_0 blocks, rounding to nearest with d = max|w| / 127."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1) / 127).half().float()  # the scale as the block stores it, so codes round to it
    codes = torch.round(blocks / d.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).clamp(-127, 127)
    return pack_q8_0(codes.reshape(rows, cols), d)


def pack_q4_0(codes: torch.Tensor, d: torch.Tensor) -> GGMLTensor:
    """codes 0..15 [rows, cols], d [rows, cols / 32]: weight = d * (code - 8)."""
    rows, cols = codes.shape
    return _blocks(rows, cols, Q.Q4_0, _fp16_bytes(d), _nibbles(codes.view(rows, -1, BLOCK)))


def pack_q4_1(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> GGMLTensor:
    """codes 0..15 [rows, cols], d and m [rows, cols / 32]: weight = d * code + m."""
    rows, cols = codes.shape
    return _blocks(rows, cols, Q.Q4_1, _fp16_bytes(d), _fp16_bytes(m), _nibbles(codes.view(rows, -1, BLOCK)))

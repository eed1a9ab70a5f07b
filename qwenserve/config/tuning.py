"""Row thresholds of the CPU paths, one table per CPU feature class: from how many activation rows a quantized
layer dequantizes and runs a dense matmul instead of int8 dot products, how many int8 codes each activation
gets, how many rows the MLP takes at a time, how many tokens a step takes under pipeline parallelism and how the
LM head counts when layers are split into stages. Each value is what a measurement chose: docs/tuning.md gives
it, under the field's name.

The classes are those the code tells apart: `amx` (AMX tiles; bf16 in hardware), `avx512_bf16` (AVX512-BF16
without AMX) and `portable` (every other CPU, AVX2 and AVX-512 without BF16 included: bf16 matmuls are emulated
there). Whether an int8 tile kernel runs a block type (AVX512-VNNI's, or AVX2's 256-bit one) is the compiled kernels'
answer (ggml_mm_tiles), not the table's.

The class is the CPU's, whichever kernel variant runs (the setting cpu_isa): what the table decides is where
PyTorch's dense matmuls (oneDNN, which uses the CPU's bf16 and AMX whatever our library was compiled for) take over
from our kernels, and whatever depends on the variant is asked of its library (a forced avx2 variant on an AMX
CPU has only the AVX2 tiles, which the tile thresholds then govern)."""
from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass

import torch

NEVER = sys.maxsize  # a row threshold no batch reaches: the route it starts is never taken


@dataclass(frozen=True)
class CPUTuning:
    feature_class: str
    # dense route of a float32 run: float32 matmuls on float32 slices beat ggml_mm from here (tuning.md#dense-route)
    dense_from_rows_float32: int
    # dense route of a bf16 run, and the dtype it multiplies in: bf16 only where the CPU has it in hardware
    # (tuning.md#dense-route)
    dense_from_rows_bfloat16: int
    dense_dtype_bfloat16: torch.dtype
    # dense route of an fp16 run, in float32: no CPU here multiplies fp16 faster (tuning.md#dense-route)
    dense_from_rows_float16: int
    # with ggml_mm's int8 tile kernel on every segment and a bf16 dense route: from how many rows the 32-weight
    # block types still go dense (tuning.md#tiles)
    tiles_dense_from_rows_32_blocks: int
    # the same where ggml_mm runs its AMX bf16 kernel for them (ggml_amx_bf16_tiles); None: as without it
    # (tuning.md#tiles)
    amx_tiles_dense_from_rows_32_blocks: int | None
    # the same for layers with K-quant blocks; None: the dense route's own threshold (tuning.md#tiles)
    tiles_dense_from_rows_k_quants: int | None
    # the same where ggml_mm runs its AMX kernel for the K-quants (ggml_amx_tiles); None: as without it
    # (tuning.md#tiles)
    amx_tiles_dense_from_rows_k_quants: int | None
    # with the tile kernel and a float32 dense route (float32 and fp16 runs) (tuning.md#tiles)
    tiles_dense_from_rows_float32: int
    # int8 codes per activation in a float32 run: two follow the exact path's greedy tokens (tuning.md#activation-codes)
    activation_codes_float32: int
    # int8 codes per activation in a bf16 or fp16 run, whatever the rows (tuning.md#activation-codes)
    activation_codes_half: int
    # weights dequantized at a time on the dense route: the slice stays in cache (tuning.md#dense-slice-weights)
    dense_slice_weights: int
    # the MLP takes longer batches in slices of this many rows: its activation then stays in cache
    # (tuning.md#mlp-rows-per-pass)
    mlp_rows_per_pass: int
    # tokens one step takes while several are in flight (pipeline parallel): shorter fill and drain
    # (tuning.md#pipelined-step-tokens)
    pipelined_step_tokens: int
    # the LM head's weights count at this share when pipeline stages are balanced (tuning.md#head-cost-share)
    head_cost_share: float
    # FP8 layers run bf16 activations on fp8_mm's tiles from this many rows, where the kernels have them; below
    # (and where the CPU multiplies bf16 faster on AMX) as before (tuning.md#fp8-tiles-from-rows)
    fp8_tiles_from_rows: int


PORTABLE = CPUTuning(
    feature_class="portable",
    dense_from_rows_float32=64,
    dense_from_rows_bfloat16=128,
    dense_dtype_bfloat16=torch.float32,
    dense_from_rows_float16=128,
    tiles_dense_from_rows_32_blocks=NEVER,
    amx_tiles_dense_from_rows_32_blocks=None,
    tiles_dense_from_rows_k_quants=NEVER,
    amx_tiles_dense_from_rows_k_quants=None,
    tiles_dense_from_rows_float32=NEVER,
    activation_codes_float32=2,
    activation_codes_half=1,
    dense_slice_weights=1 << 20,
    mlp_rows_per_pass=512,
    pipelined_step_tokens=512,
    head_cost_share=0.6,
    fp8_tiles_from_rows=NEVER,
)
AVX512_BF16 = dataclasses.replace(PORTABLE, feature_class="avx512_bf16", dense_from_rows_bfloat16=32,
                                  dense_dtype_bfloat16=torch.bfloat16, fp8_tiles_from_rows=32)
AMX = dataclasses.replace(AVX512_BF16, feature_class="amx", tiles_dense_from_rows_32_blocks=128,
                          amx_tiles_dense_from_rows_32_blocks=512, tiles_dense_from_rows_k_quants=96,
                          amx_tiles_dense_from_rows_k_quants=512, fp8_tiles_from_rows=NEVER)
TUNING_BY_CLASS = {t.feature_class: t for t in (AMX, AVX512_BF16, PORTABLE)}


def cpu_feature_class() -> str:
    """This CPU's class in TUNING_BY_CLASS, from the features torch detects."""
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "amx"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "avx512_bf16"
    return "portable"


@functools.cache
def this_cpu_tuning() -> CPUTuning:
    """The table for the CPU this process runs on."""
    return TUNING_BY_CLASS[cpu_feature_class()]

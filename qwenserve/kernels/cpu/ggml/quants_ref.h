// The scalar reference of the ggml kernels: block decoding, the activation quantizers (ggml's
// quantize_row_q8_0_ref and quantize_row_q8_K_ref) and the dot products, in plain C++ that every CPU compiles
// (quants_ref.cpp is built everywhere). dispatch.cpp runs it where no arch/ kernel applies, and the tests compare
// the baseline variant (no arch/ kernels) with every other: the same integer sum per block, so the same
// dequantized bits and the same products up to float summation order.
#pragma once

#include <cstdint>

#include "ggml/common.h"

namespace qwenserve::cpu::ggml::ref {

// One block -> float32, with qwenserve/model/loader/dequant.py's operations, bit for bit: every product there is
// exact in float32 (an fp16 mantissa times integers of at most 13 bits), so only the final addition of Q4_1's m
// and the K-quants' final subtraction round, once (the same whether or not the compiler fuses them into an fma).
void dequantize_block(int64_t type, const uint8_t* b, float* out);

// nb blocks of x -> y (T: float, c10::BFloat16, c10::Half)
template <typename T>
void quantize_row_q8_0(const T* x, int64_t nb, ActQ8_0* y);
template <typename T>
void quantize_row_q8_K(const T* x, int64_t nb, ActQ8_K* y);

// res[r] = sum_k w[k] * y[r][k] for R (1..4) activation rows, over nb blocks of one weight row (block b at
// w + b * bstride)
template <typename Kernel, int R>
void dot_rows(const uint8_t* w, int64_t bstride, int64_t nb, const typename Kernel::Act* const* y, float* res);

}  // namespace qwenserve::cpu::ggml::ref

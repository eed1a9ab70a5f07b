// What every part of the ggml kernels shares: the weight types and their block layouts, the activation blocks
// (q8_0, q8_K), one kernel type per weight type (its block's constants, the same on every CPU), the row layouts
// and the store of a pass's results. The scalar reference is quants_ref.h, the x86 kernels arch/x86/, and
// dispatch.cpp picks among them.
//
// Block layouts (ggml-common.h; all fields little-endian, fp16 = IEEE half):
//   Q4_0  18 B: d fp16, qs[16]: weight j = qs[j] & 15, weight j+16 = qs[j] >> 4;          x = d (q - 8)
//   Q4_1  20 B: d, m fp16, qs[16] as Q4_0;                                                x = d q + m
//   Q5_0  22 B: d, qh[4] (bit i of the LE uint32 = 5th bit of weight i), qs[16] as Q4_0;  x = d (q - 16)
//   Q8_0  34 B: d, qs[32] int8;                                                          x = d q
//   Q4_K 144 B: d, dmin, scales[12] (8 six-bit scales and mins), qs[128]: chunk c of 32 bytes holds sub-blocks
//               2c (low nibbles) and 2c+1 (high nibbles);                  x = d sc[s] q - dmin m[s], s = i / 32
//   Q5_K 176 B: d, dmin, scales[12], qh[32] (5th bit of weight 32 s + l = bit s of qh[l]), qs[128] as Q4_K
//   Q6_K 210 B: ql[128], qh[64], scales[16] int8, d: per half h of 128 weights, l < 32, n = 128 h:
//               w[n+l], w[n+l+32], w[n+l+64], w[n+l+96] = low / low / high / high nibble of ql[64h+l],
//               ql[64h+32+l], ql[64h+l], ql[64h+32+l], each | 2 bits (0, 2, 4, 6) of qh[32h+l] << 4;
//                                                                          x = d scales[i / 16] (q - 32)
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#include "cpu_features.h"
#include "vec.h"

namespace qwenserve::cpu::ggml {

constexpr int64_t kDecodeGroup = 8;  // rows per group in the decode layout (see Layout)

enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct BlockInfo {
  int64_t elems, bytes;
};

inline BlockInfo block_info(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: break;
  }
  TORCH_CHECK(false, "ggml type ", type,
              " is not supported (Q4_0=2, Q4_1=3, Q5_0=6, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
}

inline float fp16_at(const uint8_t* p) {
  const uint16_t h = static_cast<uint16_t>(p[0] | (p[1] << 8));
#if QS_X86_F16C
  return _cvtsh_ss(h);
#elif QS_ARM_NEON
  __fp16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Activation blocks (ggml's block_q8_0 and block_q8_K, with the sums the kernels need precomputed)

struct ActQ8_0 {  // 32 activations
  float d;        // the fp16 scale, as float
  int32_t sum;    // sum of qs
  int32_t quad_sums[2];  // sums of qs over quads 0, 2, 4, 6 and over 1, 3, 5, 7 (4 qs a quad; the tile kernel's)
  int8_t qs[32];
};

struct ActQ8_K {  // 256 activations
  float d;
  int16_t bsums[16];    // sums of 16
  int16_t bsums32[8];   // sums of 32 (for the Q4_K/Q5_K mins)
  int8_t qs[256];
};

// ---------------------------------------------------------------------------------------------------------------
// Kernel types, one per weight type: where a block keeps its scales and how its integer dot product with an
// activation block becomes a float. Per block, a row gets
//   d * a.d * (sum of code x activation products - int_offset) + kMinSign * m * a.d * min_sum
// with d and m the fp16s at kScaleAt and kMinScaleAt, int_offset the codes' fixed offset folded in through the
// activation block's sums (kHasOffset) and min_sum an integer for Q4_1's m and the K-quants' mins (kHasMinTerm).
// Every implementation (quants_ref.h, arch/*/) forms that same integer sum per block; they differ only in float
// summation order.

// Q4_0, Q4_1 and Q5_0: unsigned codes. Q4_0, Q5_0: sum (q - off) y = sum q y - off * sum y, the correction in
// integers; Q4_1: sum (d q + m) y = d sum q y + m sum y, the min's term in float (m dy sum y per block).
template <int64_t Type>
struct LegacyUnsigned {
  static constexpr int64_t kType = Type;
  static constexpr int kQs = Type == kQ4_0 ? 2 : Type == kQ4_1 ? 4 : 6;  // where the packed nibbles start
  static constexpr int64_t kBlock = 32, kBytes = kQs + 16, kScaleAt = 0;
  static constexpr int32_t kOff = Type == kQ4_0 ? 8 : Type == kQ5_0 ? 16 : 0;
  static constexpr bool kHasOffset = kOff != 0, kHasMinTerm = Type == kQ4_1;
  static constexpr int64_t kMinScaleAt = 2;
  static constexpr float kMinSign = 1.0f;
  using Act = ActQ8_0;
};

// Q8_0: signed codes
struct Q8_0Kernel {
  static constexpr int64_t kType = kQ8_0;
  static constexpr int64_t kBlock = 32, kBytes = 34, kScaleAt = 0, kMinScaleAt = 0;
  static constexpr bool kHasOffset = false, kHasMinTerm = false;
  static constexpr float kMinSign = 0.0f;
  using Act = ActQ8_0;
};

// Q4_K and Q5_K: per super-block, isum = sum_s sc[s] sum_{i in s} q_i y_i and msum = sum_s m[s] sum_{i in s} y_i;
// the row gets d dy isum - dmin dy msum.
template <int64_t Type>
struct KQuant45 {
  static constexpr int64_t kType = Type;
  static constexpr int64_t kBlock = 256, kBytes = Type == kQ4_K ? 144 : 176, kScaleAt = 0;
  static constexpr int kQs = Type == kQ4_K ? 16 : 48;
  static constexpr bool kHasOffset = false, kHasMinTerm = true;
  static constexpr int64_t kMinScaleAt = 2;
  static constexpr float kMinSign = -1.0f;
  using Act = ActQ8_K;
};

// Q6_K: isum = sum_j sc[j] (sum_{i in j} q_i y_i - 32 bsum_j) over the 16 sub-blocks of 16; the row gets d dy isum.
struct Q6_KKernel {
  static constexpr int64_t kType = kQ6_K;
  static constexpr int64_t kBlock = 256, kBytes = 210, kScaleAt = 208, kMinScaleAt = 0;
  static constexpr bool kHasOffset = false, kHasMinTerm = false;
  static constexpr float kMinSign = 0.0f;
  using Act = ActQ8_K;
};

// ---------------------------------------------------------------------------------------------------------------
// Where a weight row's blocks lie. group 1: a GGUF file's layout, row after row. group 8 (kDecodeGroup): rows in
// groups of 8 with block b of all 8 side by side, so that the decode kernels read the 8 rows they work on as one
// stream; same bytes. ld: bytes per row.
struct Layout {
  const uint8_t* base;
  int64_t ld, group, block_bytes;
  const uint8_t* row(int64_t n) const { return base + (n / group) * group * ld + (n % group) * block_bytes; }
  int64_t block_stride() const { return group * block_bytes; }
};

// A pass's results for quantized rows m0 .. m0 + r - 1 and weight rows col .. col + Width - 1 -> out, with the
// bias. With `levels` quantized rows per output row (ggml_mm's act_levels; passes cover whole groups of them, r
// and m0 being multiples of levels) a row's levels are summed here, in float, before the one rounding.
template <int Width, typename T>
inline void store_rows(T* out, int64_t ldo, int64_t levels, int64_t m0, int r, int64_t col, const float* res,
                       const float* bias) {  // res: [r][Width]
  for (int i = 0; i < r; i += static_cast<int>(levels))
    for (int k = 0; k < Width; ++k) {
      float v = bias ? res[i * Width + k] + bias[col + k] : res[i * Width + k];
      if (levels == 2) v += res[(i + 1) * Width + k];
      out[(m0 + i) / levels * ldo + col + k] = from_float<T>(v);
    }
}

}  // namespace qwenserve::cpu::ggml

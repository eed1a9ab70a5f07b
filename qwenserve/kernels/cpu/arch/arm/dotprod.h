// The ggml decode kernels on aarch64: one weight row against up to 4 activation rows (dot_rows) and, in the
// decode layout, a group of 8 weight rows at a time (dot8), for every kernel type. Each block's signed codes
// (neon.h) meet the activation codes in sdot (dotprod) or its widening-multiply stand-in (plain Armv8), so a block
// of 32 takes two dot_s8 per activation row; the integer per block is the reference's, the float summation order
// is not.
#pragma once

#include <cstdint>
#include <cstring>

#include "arch/arm/neon.h"
#include "cpu_features.h"
#include "ggml/common.h"

#if QS_ARM_NEON

namespace qwenserve::cpu::ggml::arm {

// A kernel type's NEON half, one specialization per kernel type (common.h):
//   decode(blk) -> Codes            the block's signed codes in registers (and its integer scales and mins),
//   partials(codes, a) -> int32x4   4 int32 lanes whose sum is the block's integer dot product with a (the
//                                   codes' offset and the sub-block scales applied),
//   min_sum(codes, a) -> int32      (Kernel::kHasMinTerm) the integer that, times a.d and the fp16 at kMinScaleAt,
//                                   is added to the row (kMinSign +1) or subtracted (-1).
template <typename Kernel>
struct NeonKernel;

// Q4_0, Q4_1, Q5_0 and Q8_0: 32 codes in two vectors
template <typename Kernel>
struct NeonBlock32 {
  using Act = ActQ8_0;
  struct Codes {
    int8x16_t q[2];
  };
  static Codes decode(const uint8_t* blk) {
    Codes c;
    if constexpr (Kernel::kType == kQ8_0) decode_q8_0(blk, c.q);
    else decode_legacy<Kernel::kType>(blk, c.q);
    return c;
  }
  static int32x4_t partials(const Codes& c, const Act& a) {
    return dot_s8(dot_s8(vdupq_n_s32(0), c.q[0], load16(a.qs)), c.q[1], load16(a.qs + 16));
  }
  static int32_t min_sum(const Codes&, const Act& a) { return a.sum; }  // Q4_1: m times the activations' sum
};
template <int64_t Type>
struct NeonKernel<LegacyUnsigned<Type>> : NeonBlock32<LegacyUnsigned<Type>> {};
template <>
struct NeonKernel<Q8_0Kernel> : NeonBlock32<Q8_0Kernel> {};

// Q4_K and Q5_K: sum_s sc[s] (sub-block s's dot product), each sub-block of 32 one int32x4 scaled as a whole
template <int64_t Type>
struct NeonKernel<KQuant45<Type>> {
  using Act = ActQ8_K;
  struct Codes {
    int8x16_t q[16];
    uint8_t scales[8], mins[8];
  };
  static Codes decode(const uint8_t* blk) {
    Codes c;
    decode_k45<Type>(blk, c.q);
    unpack_scales_mins(blk + 4, c.scales, c.mins);
    return c;
  }
  static int32x4_t partials(const Codes& c, const Act& a) {
    int32x4_t isum = vdupq_n_s32(0);
    for (int s = 0; s < 8; ++s) {
      const int32x4_t p = dot_s8(dot_s8(vdupq_n_s32(0), c.q[2 * s], load16(a.qs + 32 * s)), c.q[2 * s + 1],
                                 load16(a.qs + 32 * s + 16));
      isum = vmlaq_n_s32(isum, p, c.scales[s]);
    }
    return isum;
  }
  static int32_t min_sum(const Codes& c, const Act& a) {  // sum_s m[s] bsums32[s]
    const int16x8_t mins = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(c.mins)));
    const int16x8_t sums = vld1q_s16(a.bsums32);
    return vaddvq_s32(vmlal_high_s16(vmull_s16(vget_low_s16(mins), vget_low_s16(sums)), mins, sums));
  }
};

// Q6_K: sum_j sc[j] (sub-block j's dot product with the codes less 32), a sub-block of 16 per vector
template <>
struct NeonKernel<Q6_KKernel> {
  using Act = ActQ8_K;
  struct Codes {
    int8x16_t q[16];
    int8_t scales[16];
  };
  static Codes decode(const uint8_t* blk) {
    Codes c;
    decode_q6_k(blk, c.q);
    std::memcpy(c.scales, blk + 192, 16);
    return c;
  }
  static int32x4_t partials(const Codes& c, const Act& a) {
    int32x4_t isum = vdupq_n_s32(0);
    for (int j = 0; j < 16; ++j)
      isum = vmlaq_n_s32(isum, dot_s8(vdupq_n_s32(0), c.q[j], load16(a.qs + 16 * j)), c.scales[j]);
    return isum;
  }
  static int32_t min_sum(const Codes&, const Act&) { return 0; }
};

// ---------------------------------------------------------------------------------------------------------------
// Dot products: one weight row with R (1..4) activation rows, and 8 weight rows of the decode layout with R.

template <typename Kernel, int R>
void dot_rows(const uint8_t* w, int64_t bstride, int64_t nb, const typename Kernel::Act* const* y, float* res) {
  using Block = NeonKernel<Kernel>;
  float acc[R] = {}, extra[R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bstride;
    const typename Block::Codes c = Block::decode(blk);  // once for all R activation rows
    const float d = fp16_at(blk + Kernel::kScaleAt);
    const float m = Kernel::kHasMinTerm ? Kernel::kMinSign * fp16_at(blk + Kernel::kMinScaleAt) : 0.0f;
    for (int r = 0; r < R; ++r) {
      const typename Kernel::Act& a = y[r][b];
      acc[r] += (d * a.d) * static_cast<float>(vaddvq_s32(Block::partials(c, a)));
      if constexpr (Kernel::kHasMinTerm) extra[r] += (m * a.d) * static_cast<float>(Block::min_sum(c, a));
    }
  }
  for (int r = 0; r < R; ++r) res[r] = acc[r] + extra[r];
}

// One group of 8 weight rows in the decode layout (block b of row r at w + (8 b + r) kBytes, see Layout) against
// R activation rows: res[i][r] = row r . activation row i. Per block, the 8 rows' partial sums fold into two
// vectors (rows 0-3, 4-7) by pairwise adds, so the scales and the accumulation run 4 rows per instruction, and
// the weights are read as one stream (no software read-ahead: unmeasured on ARM, whose cores prefetch a stream).
template <typename Kernel, int R>
void dot8(const uint8_t* w, int64_t nb, const typename Kernel::Act* const* y, float (*res)[8]) {
  using Block = NeonKernel<Kernel>;
  constexpr int64_t kGroupBytes = 8 * Kernel::kBytes;
  float32x4_t acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kGroupBytes;
    int32x4_t sums[R][2];      // lane k: row 4 half + k's integer sum
    int32_t min_sums[R][8];    // the 8 rows' min_sum, applied together below
    for (int half = 0; half < 2; ++half) {
      int32x4_t s[4][R];
      for (int k = 0; k < 4; ++k) {
        const int r = 4 * half + k;
        const typename Block::Codes c = Block::decode(blk + r * Kernel::kBytes);
        for (int i = 0; i < R; ++i) {
          s[k][i] = Block::partials(c, y[i][b]);
          if constexpr (Kernel::kHasMinTerm) min_sums[i][r] = Block::min_sum(c, y[i][b]);
        }
      }
      for (int i = 0; i < R; ++i)
        sums[i][half] = vpaddq_s32(vpaddq_s32(s[0][i], s[1][i]), vpaddq_s32(s[2][i], s[3][i]));
    }
    const float32x4_t d[2] = {fp16x4(blk + Kernel::kScaleAt, Kernel::kBytes),
                              fp16x4(blk + 4 * Kernel::kBytes + Kernel::kScaleAt, Kernel::kBytes)};
    for (int i = 0; i < R; ++i)
      for (int half = 0; half < 2; ++half)
        acc[i][half] = vfmaq_f32(acc[i][half], vmulq_n_f32(d[half], y[i][b].d), vcvtq_f32_s32(sums[i][half]));
    if constexpr (Kernel::kHasMinTerm) {
      const float32x4_t m[2] = {fp16x4(blk + Kernel::kMinScaleAt, Kernel::kBytes),
                                fp16x4(blk + 4 * Kernel::kBytes + Kernel::kMinScaleAt, Kernel::kBytes)};
      for (int i = 0; i < R; ++i)
        for (int half = 0; half < 2; ++half)
          acc[i][half] = vfmaq_f32(acc[i][half], vmulq_n_f32(m[half], Kernel::kMinSign * y[i][b].d),
                                   vcvtq_f32_s32(vld1q_s32(min_sums[i] + 4 * half)));
    }
  }
  for (int i = 0; i < R; ++i) {
    vst1q_f32(res[i], acc[i][0]);
    vst1q_f32(res[i] + 4, acc[i][1]);
  }
}

}  // namespace qwenserve::cpu::ggml::arm

#endif  // QS_ARM_NEON

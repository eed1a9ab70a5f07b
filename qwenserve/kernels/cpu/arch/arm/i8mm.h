// The ggml tile kernel on aarch64 with i8mm: for many activation rows (batched decode, prefill) a group of 8 weight
// rows in the decode layout is decoded once per call into the operands smmla (vmmlaq_s32) takes as they are, then
// swept by the activation rows two at a time (mm_tiles). smmla multiplies a 2x8 by an 8x2 int8 matrix into a 2x2
// int32 tile: two activation rows' 8 codes against two weight rows' 8 codes, 4 dot products of 8 in one
// instruction, where sdot gives 4 of 4. Below kTileMinRows activation rows the decode kernels (dotprod.h) run.
// Speed unmeasured (no ARM machine at hand): kTileMinRows is where the tiles start to pay on x86 (vnni_tiles.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "arch/arm/dotprod.h"
#include "arch/arm/neon.h"
#include "cpu_features.h"
#include "ggml/common.h"

#if QS_ARM_I8MM

namespace qwenserve::cpu::ggml::arm {

// Rows 2p and 2p + 1's codes 8j .. 8j + 7, side by side (smmla's weight operand): from two rows' vectors of 16
// codes, the low (j even) or the high (j odd) 8 of each
inline int8x16_t row_pair(int8x16_t a, int8x16_t b, int j) {
  const int64x2_t a64 = vreinterpretq_s64_s8(a), b64 = vreinterpretq_s64_s8(b);
  return vreinterpretq_s8_s64(j % 2 == 0 ? vzip1q_s64(a64, b64) : vzip2q_s64(a64, b64));
}

// Two activation rows' codes 8c .. 8c + 7 (smmla's activation operand)
inline int8x16_t act_pair(const int8_t* a0, const int8_t* a1, int c) {
  return vcombine_s8(vld1_s8(a0 + 8 * c), vld1_s8(a1 + 8 * c));
}

// A pair tile [i r2p, i r2p+1, i' r2p, i' r2p+1] for p = 0..3 -> activation row i's rows 0-3 and 4-7 (first) or
// row i''s (second)
inline void by_activation_row(const int32x4_t* tile, int32x4_t* first, int32x4_t* second) {
  for (int h = 0; h < 2; ++h) {
    const int64x2_t lo = vreinterpretq_s64_s32(tile[2 * h]), hi = vreinterpretq_s64_s32(tile[2 * h + 1]);
    first[h] = vreinterpretq_s32_s64(vzip1q_s64(lo, hi));
    second[h] = vreinterpretq_s32_s64(vzip2q_s64(lo, hi));
  }
}

// A group's blocks decoded for smmla, one struct per block, per kernel type
template <typename Kernel, bool kSuper = Kernel::kBlock == 256>
struct TileGroup;

// Q4_0, Q4_1, Q5_0 and Q8_0: 4 row pairs x 4 chunks of 8 codes
template <typename Kernel>
struct TileGroup<Kernel, false> {
  struct Block {
    int8x16_t codes[4][4];  // [pair p][chunk j]: rows 2p, 2p + 1's codes 8j .. 8j + 7
    float32x4_t d[2], m[2];  // rows 0-3, 4-7 (m: Q4_1)
  };
  static void decode(const uint8_t* blk, Block& t) {
    for (int p = 0; p < 4; ++p) {
      const auto r0 = NeonKernel<Kernel>::decode(blk + 2 * p * Kernel::kBytes);
      const auto r1 = NeonKernel<Kernel>::decode(blk + (2 * p + 1) * Kernel::kBytes);
      for (int j = 0; j < 4; ++j) t.codes[p][j] = row_pair(r0.q[j / 2], r1.q[j / 2], j);
    }
    for (int h = 0; h < 2; ++h) {
      t.d[h] = fp16x4(blk + 4 * h * Kernel::kBytes + Kernel::kScaleAt, Kernel::kBytes);
      t.m[h] = Kernel::kHasMinTerm ? fp16x4(blk + 4 * h * Kernel::kBytes + Kernel::kMinScaleAt, Kernel::kBytes)
                                   : vdupq_n_f32(0.0f);
    }
  }
  // activation rows a0, a1 against the block: acc[0] (a0) and acc[1] (a1), rows 0-3 and 4-7 each
  static void add(const Block& t, const ActQ8_0& a0, const ActQ8_0& a1, float32x4_t (*acc)[2]) {
    int8x16_t act[4];
    for (int c = 0; c < 4; ++c) act[c] = act_pair(a0.qs, a1.qs, c);
    int32x4_t tile[4], sums[2][2];
    for (int p = 0; p < 4; ++p) {
      tile[p] = vdupq_n_s32(0);
      for (int c = 0; c < 4; ++c) tile[p] = vmmlaq_s32(tile[p], act[c], t.codes[p][c]);
    }
    by_activation_row(tile, sums[0], sums[1]);
    const ActQ8_0* a[2] = {&a0, &a1};
    for (int i = 0; i < 2; ++i)
      for (int h = 0; h < 2; ++h) {
        acc[i][h] = vfmaq_f32(acc[i][h], vmulq_n_f32(t.d[h], a[i]->d), vcvtq_f32_s32(sums[i][h]));
        if constexpr (Kernel::kHasMinTerm)
          acc[i][h] = vfmaq_n_f32(acc[i][h], t.m[h], a[i]->d * static_cast<float>(a[i]->sum));
      }
  }
};

// Q4_K, Q5_K and Q6_K: 4 row pairs x 32 chunks of 8 codes, each sub-block's (8 of 32, or Q6_K's 16 of 16) tile
// scaled by its rows' scales, the K-quants' mins as int16 products with the activations' sums of 32
template <typename Kernel>
struct TileGroup<Kernel, true> {
  static constexpr bool kQ6 = std::is_same_v<Kernel, Q6_KKernel>;
  static constexpr int kSubBlocks = kQ6 ? 16 : 8, kChunks = 32 / kSubBlocks;  // chunks of 8 codes a sub-block
  struct Block {
    int8x16_t codes[4][32];          // [pair p][chunk c]: rows 2p, 2p + 1's codes 8c .. 8c + 7
    int32x4_t scales[4][kSubBlocks];  // [pair p][sub-block]: lanes row 2p, 2p + 1, 2p, 2p + 1
    int16x8_t mins[8];                // sub-block s: lane r = row r's min (Q4_K, Q5_K)
    float32x4_t d[2], dmin[2];        // rows 0-3, 4-7
  };
  static void decode(const uint8_t* blk, Block& t) {
    int16_t mins[8][8];
    for (int p = 0; p < 4; ++p) {
      const auto r0 = NeonKernel<Kernel>::decode(blk + 2 * p * Kernel::kBytes);
      const auto r1 = NeonKernel<Kernel>::decode(blk + (2 * p + 1) * Kernel::kBytes);
      for (int c = 0; c < 32; ++c) t.codes[p][c] = row_pair(r0.q[c / 2], r1.q[c / 2], c);
      for (int s = 0; s < kSubBlocks; ++s) {
        const int32_t s0 = r0.scales[s], s1 = r1.scales[s];
        const int32_t lanes[4] = {s0, s1, s0, s1};
        t.scales[p][s] = vld1q_s32(lanes);
      }
      if constexpr (!kQ6)
        for (int s = 0; s < 8; ++s) {
          mins[s][2 * p] = r0.mins[s];
          mins[s][2 * p + 1] = r1.mins[s];
        }
    }
    for (int s = 0; s < 8; ++s) t.mins[s] = kQ6 ? vdupq_n_s16(0) : vld1q_s16(mins[s]);
    for (int h = 0; h < 2; ++h) {
      t.d[h] = fp16x4(blk + 4 * h * Kernel::kBytes + Kernel::kScaleAt, Kernel::kBytes);
      t.dmin[h] = kQ6 ? vdupq_n_f32(0.0f) : fp16x4(blk + 4 * h * Kernel::kBytes + Kernel::kMinScaleAt,
                                                  Kernel::kBytes);
    }
  }
  static void add(const Block& t, const ActQ8_K& a0, const ActQ8_K& a1, float32x4_t (*acc)[2]) {
    int32x4_t isum[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int s = 0; s < kSubBlocks; ++s) {
      int8x16_t act[kChunks];
      for (int k = 0; k < kChunks; ++k) act[k] = act_pair(a0.qs, a1.qs, kChunks * s + k);
      for (int p = 0; p < 4; ++p) {
        int32x4_t tile = vdupq_n_s32(0);
        for (int k = 0; k < kChunks; ++k) tile = vmmlaq_s32(tile, act[k], t.codes[p][kChunks * s + k]);
        isum[p] = vmlaq_s32(isum[p], tile, t.scales[p][s]);
      }
    }
    int32x4_t sums[2][2];
    by_activation_row(isum, sums[0], sums[1]);
    const ActQ8_K* a[2] = {&a0, &a1};
    for (int i = 0; i < 2; ++i) {
      int32x4_t msum[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
      if constexpr (!kQ6)
        for (int s = 0; s < 8; ++s) {  // sum_s m[s] bsums32[s], rows 0-3 and 4-7
          msum[0] = vmlal_n_s16(msum[0], vget_low_s16(t.mins[s]), a[i]->bsums32[s]);
          msum[1] = vmlal_high_n_s16(msum[1], t.mins[s], a[i]->bsums32[s]);
        }
      for (int h = 0; h < 2; ++h) {
        acc[i][h] = vfmaq_f32(acc[i][h], vmulq_n_f32(t.d[h], a[i]->d), vcvtq_f32_s32(sums[i][h]));
        if constexpr (!kQ6)
          acc[i][h] = vfmsq_f32(acc[i][h], vmulq_n_f32(t.dmin[h], a[i]->d), vcvtq_f32_s32(msum[h]));
      }
    }
  }
};

// One group of 8 weight rows of the decode layout (block b of row r at group + (8 b + r) kBytes) -> tile[0 .. nb)
template <typename Kernel>
void decode_tile_group(const uint8_t* group, int64_t nb, typename TileGroup<Kernel>::Block* tile) {
  for (int64_t b = 0; b < nb; ++b) TileGroup<Kernel>::decode(group + b * 8 * Kernel::kBytes, tile[b]);
}

// m activation rows (row i's block b at act[i * nb + b]) against a decoded group: res[i][r] = row r . activation
// row i. Two activation rows a pass over the group's blocks (an odd last row goes with itself).
template <typename Kernel>
void tile_rows(const typename TileGroup<Kernel>::Block* tile, int64_t nb, const typename Kernel::Act* act,
               int64_t m, float (*res)[8]) {
  for (int64_t i = 0; i < m; i += 2) {
    const typename Kernel::Act* a0 = act + i * nb;
    const typename Kernel::Act* a1 = i + 1 < m ? a0 + nb : a0;
    float32x4_t acc[2][2];
    for (auto& row : acc) row[0] = row[1] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; ++b) TileGroup<Kernel>::add(tile[b], a0[b], a1[b], acc);
    for (int64_t k = 0; k < 2 && i + k < m; ++k) {
      vst1q_f32(res[i + k], acc[k][0]);
      vst1q_f32(res[i + k] + 4, acc[k][1]);
    }
  }
}

constexpr int64_t kTileMinRows = 4;
constexpr int64_t kTileRows = 16;  // activation rows a pass stores at a time

// out[M / levels, N] from M quantized activation rows in the decode layout (ggml_mm's mm_quantized): each group of
// 8 weight rows is decoded once per call (a few KiB a block, so a row's tile stays in L2), then swept by all
// activation rows
template <typename Kernel, typename T>
void mm_tiles(T* out, int64_t ldo, int64_t levels, const typename Kernel::Act* act, int64_t M, int64_t nb,
              const Layout& w, int64_t N, const float* bias) {
  at::parallel_for(0, N / 8, 1, [&](int64_t g0, int64_t g1) {
    std::vector<typename TileGroup<Kernel>::Block> tile(static_cast<size_t>(nb));
    float res[kTileRows][8];
    for (int64_t g = g0; g < g1; ++g) {
      decode_tile_group<Kernel>(w.row(8 * g), nb, tile.data());
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int r = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        tile_rows<Kernel>(tile.data(), nb, act + m0 * nb, r, res);
        store_rows<8>(out, ldo, levels, m0, r, 8 * g, res[0], bias);
      }
    }
  });
}

}  // namespace qwenserve::cpu::ggml::arm

#endif  // QS_ARM_I8MM

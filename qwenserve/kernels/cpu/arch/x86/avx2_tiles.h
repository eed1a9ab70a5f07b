// The ggml tile kernels in 256-bit registers, for x86 CPUs without AVX512-VNNI (AVX2 servers and laptops, and
// AVX-VNNI clients): for many activation rows (batched decode, prefill) a group of 8 weight rows in the decode
// layout is decoded once per call, one row per int32 lane (vector q holds quad q, codes 4q..4q+3, of all 8 rows),
// then swept by all activation rows: an activation row's quad, broadcast, meets the 8 rows in one u8 x s8 dot
// product. Below kAvx2TileMinRows rows the decode kernel (avx2.h's dot8) streams the weights faster.
//
// Without 256-bit VNNI the u8 x s8 products go through _mm256_maddubs_epi16, whose int16 pair sums saturate, and
// _mm256_madd_epi16, which widens them to int32 (and multiplies by the sub-block scale on the way). The pair sums of
// several quads are added in int16 before widening, as many as stay exact: a pair sum is at most 2 x the largest
// code x 128 in magnitude (activation codes lie in [-128, 127]; ggml's q8_0 and q8_K quantizers give [-127, 127]),
// so kInt16Quads quads of it stay within int16. With vpdpbusd on 256-bit vectors (AVX512-VNNI with VL, AVX-VNNI) the
// products go straight into int32. Either way each block's integer sum is the reference's.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "arch/x86/avx2.h"
#include "arch/x86/tile_sweeps.h"
#include "cpu_features.h"
#include "ggml/common.h"

#if QS_X86_AVX2 && !QS_X86_AVX512_VNNI

// the u8 x s8 dot products straight into int32 lanes (vpdpbusd on 256-bit vectors)
#define QS_AVX2_TILES_DPBUSD (QS_X86_AVX512_VNNI_VL || QS_X86_AVX_VNNI)

namespace qwenserve::cpu::ggml::x86 {

// below this many activation rows the decode kernel (dot8) is faster; from it the verify step of 5 speculative
// tokens takes the tiles (docs/performance.md, the AVX2 tile kernels)
constexpr int64_t kAvx2TileMinRows = 6;
constexpr int kAvx2TileRows = 8;  // activation rows per pass over a decoded group

// The largest unsigned code the sweeps meet per kernel type. Q8_0's signed codes are moved up by 128 with vpdpbusd;
// without it they take the sign trick instead (below).
template <typename Kernel>
constexpr int kMaxCode = 15;
template <>
constexpr int kMaxCode<LegacyUnsigned<kQ5_0>> = 31;
template <>
constexpr int kMaxCode<KQuant45<kQ5_K>> = 31;
template <>
constexpr int kMaxCode<Q6_KKernel> = 63;

// quads whose maddubs pair sums add up in int16 exactly: 8 (codes <= 15), 4 (<= 31), 2 (<= 63)
template <typename Kernel>
constexpr int kInt16Quads = 32767 / (2 * 128 * kMaxCode<Kernel>);
static_assert(kInt16Quads<LegacyUnsigned<kQ4_0>> == 8 && kInt16Quads<KQuant45<kQ5_K>> == 4 &&
              kInt16Quads<Q6_KKernel> == 2);

// Q8_0 without vpdpbusd: the sign trick, as avx2.h's dot_u8s8 (|q| the unsigned operand, q's signs moved onto
// the broadcast activation quad). It is exact because q8_0 activation codes lie in [-127, 127] (d = amax / 127),
// so no sign flip wraps, and a pair sum is at most 2 x 128 x 127 in magnitude, within int16.
constexpr bool kAvx2Q8SignTrick = !QS_AVX2_TILES_DPBUSD;

// Q8_0 under the sign trick decodes no cheaper than dot8 reads it, so the tiles pay only once enough rows share
// each decoded group (docs/performance.md, Q8_0 on the AVX2 tiles)
template <typename Kernel>
constexpr int64_t kAvx2TileMinRowsFor =
    std::is_same_v<Kernel, Q8_0Kernel> && kAvx2Q8SignTrick ? 16 : kAvx2TileMinRows;

// The offset the codes carry (Q4_0 8, Q5_0 16, Q8_0's 128 under vpdpbusd), taken off through the activation block's
// sum
template <typename Kernel>
constexpr int32_t kAvx2TileOffset = 0;
template <int64_t Type>
constexpr int32_t kAvx2TileOffset<LegacyUnsigned<Type>> = LegacyUnsigned<Type>::kOff;
template <>
constexpr int32_t kAvx2TileOffset<Q8_0Kernel> = kAvx2Q8SignTrick ? 0 : 128;

// the 4 bytes at p in every int32 lane: an activation quad, or a pair of int16 sums
inline __m256i broadcast_quad(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Quads 0 .. N - 1 of the codes against the activation quads at qs, each lane's sum in int32, times `scale`: with
// vpdpbusd an int32 per lane (a null scale: none), without it the int16 pair (s, s) per lane that
// _mm256_madd_epi16 takes (a null scale: ones)
template <typename Kernel, int N>
inline __m256i dot_quads(const __m256i* codes, const int8_t* qs, const __m256i* scale) {
#if QS_AVX2_TILES_DPBUSD
  __m256i s = _mm256_setzero_si256();
  for (int q = 0; q < N; ++q) {
#if QS_X86_AVX512_VNNI_VL
    s = _mm256_dpbusd_epi32(s, codes[q], broadcast_quad(qs + 4 * q));
#else
    s = _mm256_dpbusd_avx_epi32(s, codes[q], broadcast_quad(qs + 4 * q));
#endif
  }
  return scale ? _mm256_mullo_epi32(s, *scale) : s;
#else
  constexpr int kRun = kInt16Quads<Kernel>;
  static_assert(N % kRun == 0 || N < kRun);
  const __m256i widen = scale ? *scale : _mm256_set1_epi16(1);
  __m256i s = _mm256_setzero_si256();
  for (int q0 = 0; q0 < N; q0 += kRun) {
    __m256i pairs = _mm256_maddubs_epi16(codes[q0], broadcast_quad(qs + 4 * q0));
    for (int q = q0 + 1; q < std::min(N, q0 + kRun); ++q)
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(codes[q], broadcast_quad(qs + 4 * q)));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs, widen));
  }
  return s;
#endif
}

// 8 rows' 32-code chunks (one vector each) -> out[q]: lane r = row r's codes 4q..4q+3
inline void transpose_8x8(const __m256i* rows, __m256i* out) {
  __m256i t[8], u[8];
  for (int k = 0; k < 4; ++k) {  // 128-bit lanes: dwords 0, 1 / 2, 3 (and 4 .. 7 above) of rows 2k, 2k + 1
    t[2 * k] = _mm256_unpacklo_epi32(rows[2 * k], rows[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_epi32(rows[2 * k], rows[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h + 3: dword d in the low 128-bit lane, d + 4 in the high one
    const __m256i* th = t + 4 * h;
    u[4 * h + 0] = _mm256_unpacklo_epi64(th[0], th[2]);  // d = 0
    u[4 * h + 1] = _mm256_unpackhi_epi64(th[0], th[2]);  // 1
    u[4 * h + 2] = _mm256_unpacklo_epi64(th[1], th[3]);  // 2
    u[4 * h + 3] = _mm256_unpackhi_epi64(th[1], th[3]);  // 3
  }
  for (int d = 0; d < 4; ++d) {
    out[d] = _mm256_permute2x128_si256(u[d], u[4 + d], 0x20);
    out[d + 4] = _mm256_permute2x128_si256(u[d], u[4 + d], 0x31);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Q4_0, Q4_1, Q5_0 and Q8_0: a block of 32 of 8 rows

template <typename Kernel>
struct Avx2TileBlock {
  // Q8_0 under the sign trick: vectors 0-7 |q|, 8-15 q
  static constexpr int kVectors = std::is_same_v<Kernel, Q8_0Kernel> && kAvx2Q8SignTrick ? 16 : 8;
  __m256i codes[kVectors];  // vector q: lane r = row r's codes 4q..4q+3
  __m256 scale;             // lane r: row r's d
  __m256 min;               // Q4_1: lane r: row r's m
};

template <typename Kernel>
inline void decode_avx2_tile(const uint8_t* blk, Avx2TileBlock<Kernel>& t) {
  __m256i rows[8], high[8];
  for (int r = 0; r < 8; ++r) {
    const uint8_t* rb = blk + r * Kernel::kBytes;
    if constexpr (std::is_same_v<Kernel, Q8_0Kernel>) {
      const typename Avx2Kernel<Kernel>::Codes c = Avx2Kernel<Kernel>::decode(rb);
      if constexpr (kAvx2Q8SignTrick) {
        rows[r] = c.abs_q;
        high[r] = c.q;
      } else {
        rows[r] = _mm256_xor_si256(c.q, _mm256_set1_epi8(-128));  // q + 128, unsigned
      }
    } else {
      rows[r] = Avx2Kernel<Kernel>::decode(rb).q;
    }
  }
  transpose_8x8(rows, t.codes);
  if constexpr (Avx2TileBlock<Kernel>::kVectors == 16) transpose_8x8(high, t.codes + 8);
  t.scale = fp16x8(blk + Kernel::kScaleAt, Kernel::kBytes);
  if constexpr (Kernel::kHasMinTerm) t.min = fp16x8(blk + Kernel::kMinScaleAt, Kernel::kBytes);
}

// R activation rows (block b of row i at act[i * nb + b]) against one decoded group: res[i][r] = row r . row i
template <typename Kernel, int R, typename TileOf>
std::enable_if_t<Kernel::kBlock == 32> avx2_tile_rows(TileOf tile_of, int64_t nb, const ActQ8_0* act,
                                                      float (*res)[8]) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Avx2TileBlock<Kernel>& t = tile_of(b);
    if constexpr (Avx2TileBlock<Kernel>::kVectors == 16) {
      // quad by quad, so that each code vector is loaded once for all R rows (the loads, not the arithmetic,
      // bound a row-by-row loop here: 16 code vectors do not stay in AVX2's 16 registers)
      __m256i s[R];
      for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
      for (int q = 0; q < 8; ++q) {
        const __m256i mag = t.codes[q], sign = t.codes[8 + q];
        for (int i = 0; i < R; ++i)
          s[i] = _mm256_add_epi32(
              s[i], dot_u8s8(mag, _mm256_sign_epi8(broadcast_quad(act[i * nb + b].qs + 4 * q), sign)));
      }
      for (int i = 0; i < R; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(t.scale, _mm256_set1_ps(act[i * nb + b].d)),
                                 acc[i]);
      continue;
    }
    for (int i = 0; i < R; ++i) {
      const ActQ8_0& a = act[i * nb + b];
      const __m256i s = _mm256_add_epi32(_mm256_set1_epi32(-kAvx2TileOffset<Kernel> * a.sum),
                                         dot_quads<Kernel, 8>(t.codes, a.qs, nullptr));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(t.scale, _mm256_set1_ps(a.d)), acc[i]);
      if constexpr (Kernel::kHasMinTerm)
        acc[i] = _mm256_fmadd_ps(t.min, _mm256_set1_ps(a.d * static_cast<float>(a.sum)), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(res[i], acc[i]);
}

// ---------------------------------------------------------------------------------------------------------------
// Q4_K, Q5_K and Q6_K: a super-block (256 weights) of 8 rows. Each sub-block's dot products (8 of 32, or Q6_K's
// 16 of 16) are scaled for all 8 rows at once (by the widening madd, or vpmulld after vpdpbusd); the term the
// activations' sub-block sums carry (the K-quants' mins, Q6_K's offset 32 times its scales) is one int16-pair
// madd per 2 sub-blocks: lane r of u holds row r's values 2u, 2u + 1 against the broadcast sums 2u, 2u + 1.

struct Avx2TileSuperBlock {
  __m256i codes[64];   // vector q: lane r = row r's codes 4q..4q+3
  __m256i scales[16];  // sub-block j: lane r = row r's scale as dot_quads takes it (Q4_K, Q5_K: the first 8)
  __m256i pairs[8];    // u: lane r = row r's mins (Q6_K: scales) 2u, 2u + 1 as int16 (Q4_K, Q5_K: the first 4)
  __m256 d, dmin;      // lane r: row r's d (dmin: Q4_K, Q5_K)
};

// a scale as dot_quads multiplies by it: an int32, or the int16 pair (s, s)
inline int32_t dot_quads_scale(int32_t s) {
#if QS_AVX2_TILES_DPBUSD
  return s;
#else
  return static_cast<int32_t>((static_cast<uint32_t>(s) & 0xFFFFu) | (static_cast<uint32_t>(s) << 16));
#endif
}

inline int32_t int16_pair(int32_t lo, int32_t hi) {
  return static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
}

template <typename Kernel>
inline void decode_avx2_tile(const uint8_t* blk, Avx2TileSuperBlock& t) {
  constexpr bool kQ6 = std::is_same_v<Kernel, Q6_KKernel>;
  __m256i chunk[8][8];  // 32-code chunk, row
  alignas(32) int32_t scales[16][8], pairs[8][8];
  alignas(32) float d[8], dmin[8];
  for (int r = 0; r < 8; ++r) {
    const uint8_t* rb = blk + r * Kernel::kBytes;
    const typename Avx2Kernel<Kernel>::Codes c = Avx2Kernel<Kernel>::decode(rb);
    int32_t pair_values[16];  // Q6_K's 16 scales, or the 8 mins
    if constexpr (kQ6) {
      for (int i = 0; i < 8; ++i) chunk[i][r] = c.q[i];
      for (int j = 0; j < 16; ++j) {
        pair_values[j] = static_cast<int8_t>(rb[192 + j]);
        scales[j][r] = dot_quads_scale(pair_values[j]);
      }
      d[r] = fp16_at(rb + 208);
      dmin[r] = 0.0f;
    } else {
      for (int k = 0; k < 4; ++k) {  // chunk 2k: sub-block 2k (low nibbles), 2k + 1: sub-block 2k + 1
        chunk[2 * k][r] = c.lo[k];
        chunk[2 * k + 1][r] = c.hi[k];
      }
      for (int j = 0; j < 8; ++j) {
        scales[j][r] = dot_quads_scale(c.scales[j]);
        pair_values[j] = c.scales[8 + j];
      }
      d[r] = fp16_at(rb);
      dmin[r] = fp16_at(rb + 2);
    }
    for (int u = 0; u < (kQ6 ? 8 : 4); ++u) pairs[u][r] = int16_pair(pair_values[2 * u], pair_values[2 * u + 1]);
  }
  for (int c = 0; c < 8; ++c) transpose_8x8(chunk[c], t.codes + 8 * c);
  for (int j = 0; j < (kQ6 ? 16 : 8); ++j) t.scales[j] = load32(scales[j]);
  for (int u = 0; u < (kQ6 ? 8 : 4); ++u) t.pairs[u] = load32(pairs[u]);
  t.d = _mm256_load_ps(d);
  t.dmin = _mm256_load_ps(dmin);
}

// A super-block of 8 rows against one activation row, once its sub-blocks' scaled sums are in isum: the mins (or
// Q6_K's offset) and d. Lane r = row r's sum.
template <typename Kernel>
inline __m256 finish_avx2_superblock(const Avx2TileSuperBlock& t, const ActQ8_K& a, __m256i isum) {
  __m256i pairs = _mm256_setzero_si256();
  const __m256 da = _mm256_set1_ps(a.d);
  if constexpr (std::is_same_v<Kernel, Q6_KKernel>) {
    for (int u = 0; u < 8; ++u)  // sum_j sc[j] bsums[j], taken 32 times: the codes' offset
      pairs = _mm256_add_epi32(pairs, _mm256_madd_epi16(t.pairs[u], broadcast_quad(a.bsums + 2 * u)));
    isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(pairs, 5));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(t.d, da));
  } else {
    for (int u = 0; u < 4; ++u)  // sum_s m[s] bsums32[s]
      pairs = _mm256_add_epi32(pairs, _mm256_madd_epi16(t.pairs[u], broadcast_quad(a.bsums32 + 2 * u)));
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(pairs), _mm256_mul_ps(t.dmin, da),
                            _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(t.d, da)));
  }
}

// R activation rows against decoded super-blocks of 8 rows, 32 codes of each row at a time: their 8 code vectors
// are loaded once for all R rows
template <typename Kernel, int R, typename TileOf>
std::enable_if_t<Kernel::kBlock == 256> avx2_tile_rows(TileOf tile_of, int64_t nb, const ActQ8_K* act,
                                                       float (*res)[8]) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Avx2TileSuperBlock& t = tile_of(b);
    __m256i isum[R];
    for (int i = 0; i < R; ++i) isum[i] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {  // quads 8s .. 8s + 7: a sub-block of 32, or Q6_K's sub-blocks 2s and 2s + 1
      __m256i c[8];
      for (int q = 0; q < 8; ++q) c[q] = t.codes[8 * s + q];
      for (int i = 0; i < R; ++i) {
        const int8_t* qs = act[i * nb + b].qs + 32 * s;
        if constexpr (std::is_same_v<Kernel, Q6_KKernel>) {
          isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(dot_quads<Kernel, 4>(c, qs, &t.scales[2 * s]),
                                                               dot_quads<Kernel, 4>(c + 4, qs + 16,
                                                                                    &t.scales[2 * s + 1])));
        } else {
          isum[i] = _mm256_add_epi32(isum[i], dot_quads<Kernel, 8>(c, qs, &t.scales[s]));
        }
      }
    }
    for (int i = 0; i < R; ++i)
      acc[i] = _mm256_add_ps(acc[i], finish_avx2_superblock<Kernel>(t, act[i * nb + b], isum[i]));
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(res[i], acc[i]);
}

// ---------------------------------------------------------------------------------------------------------------
// The driver

// out[M, N] from weights in the decode layout, a group of 8 rows at a time (sweep_tiles)
template <typename Kernel, typename T>
void mm_avx2_tiles(T* out, int64_t ldo, int64_t levels, const typename Kernel::Act* act, int64_t M, int64_t nb,
                   const Layout& w, int64_t N, const float* bias) {
  using Tile = std::conditional_t<Kernel::kBlock == 256, Avx2TileSuperBlock, Avx2TileBlock<Kernel>>;
  sweep_tiles<Tile, 8, kAvx2TileRows, Kernel::kBytes>(
      out, ldo, levels, M, nb, w, N, bias,
      [&](const uint8_t* rows, int64_t at, Tile& t) { decode_avx2_tile<Kernel>(rows + at, t); },
      [&](auto count, const auto& tile_of, int64_t m0, float (*res)[8]) {
        avx2_tile_rows<Kernel, count()>(tile_of, nb, act + m0 * nb, res);
      });
}

}  // namespace qwenserve::cpu::ggml::x86

#endif  // QS_X86_AVX2 && !QS_X86_AVX512_VNNI

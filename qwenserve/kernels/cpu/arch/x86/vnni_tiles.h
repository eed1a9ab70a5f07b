// The ggml tile kernels (AVX512-VNNI): for several activation rows (batched decode, speculative verify, prefill) a
// group of 16 (or 8) weight rows in the decode layout is decoded into vectors that vpdpbusd takes as they are,
// then swept by all activation rows (mm_tiles16, mm_tiles); below kTileMinRows rows the decode kernels (avx2.h,
// avx512.h) stream the weights faster.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "arch/x86/avx2.h"
#include "arch/x86/avx512.h"
#include "arch/x86/tile_sweeps.h"
#include "cpu_features.h"
#include "ggml/common.h"

#if QS_X86_AVX512_VNNI

namespace qwenserve::cpu::ggml::x86 {

// Q4_0, Q4_1, Q5_0 and Q8_0 in the decode layout against many activation rows (batched decode, prefill), with
// AVX512-VNNI. A group of 8 weight rows is decoded once per call into 4 vectors per block, vector j holding codes
// 8j..8j+7 of each of the 8 rows (row r in qword r): one activation row's qword j, broadcast, then meets all 8
// rows in one u8 x s8 dot product, and 4 of them give the block's sums for the 8 rows in 16 int32 lanes (lane 2r + t:
// row r's quads of parity t). Per activation row and block that is 4 dot products, one conversion and one fma
// with the rows' scales times the activation's, where the decode kernel (dot8_legacy512) needs 4 of each. The
// codes are unsigned (Q8_0's moved up by 128); their offset enters as the dot products' starting value, -off
// times the activation block's sums over each lane's quads.
struct TileBlock {   // one block of a group of 8 rows, decoded
  __m512i codes[4];  // vector j: qword r = row r's codes 8j..8j+7
  __m512 scale;      // lanes 2r and 2r + 1: row r's d
  __m512 min;        // Q4_1: lane 2r row r's m, lane 2r + 1 zero
};

template <typename Kernel>
constexpr int32_t kTileOffset = Kernel::kOff;
template <>
constexpr int32_t kTileOffset<Q8_0Kernel> = 128;

// 32 codes of each of 8 rows, as 4 pairs of rows in pair_codes' layout -> out[j]: qword r = row r's codes 8j..8j+7
inline void interleave_rows(const __m512i* pair, __m512i* out) {
  // pair qwords: row 2p's codes 8j.. at 4 (j / 2) + j % 2, row 2p + 1's two further on
  const __m512i first = _mm512_setr_epi64(0, 2, 8, 10, 1, 3, 9, 11);
  const __m512i second = _mm512_setr_epi64(4, 6, 12, 14, 5, 7, 13, 15);
  const __m512i a01 = _mm512_permutex2var_epi64(pair[0], first, pair[1]);  // j = 0, 1 of rows 0-3
  const __m512i b01 = _mm512_permutex2var_epi64(pair[2], first, pair[3]);  // j = 0, 1 of rows 4-7
  const __m512i a23 = _mm512_permutex2var_epi64(pair[0], second, pair[1]);
  const __m512i b23 = _mm512_permutex2var_epi64(pair[2], second, pair[3]);
  out[0] = _mm512_shuffle_i64x2(a01, b01, 0x44);
  out[1] = _mm512_shuffle_i64x2(a01, b01, 0xEE);
  out[2] = _mm512_shuffle_i64x2(a23, b23, 0x44);
  out[3] = _mm512_shuffle_i64x2(a23, b23, 0xEE);
}

// two rows' 32 codes (one 256-bit vector each) in pair_codes' layout: 128-bit lanes r0 lo, r1 lo, r0 hi, r1 hi
inline __m512i pair_of(__m256i r0, __m256i r1) {
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
  return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}

// the fp16 at p + r * ld for r = 0..7, as floats in lanes 2r and 2r + 1
inline __m512 fp16x8_twice(const uint8_t* p, int64_t ld) {
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  return _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(fp16x8(p, ld)));
}

template <typename Kernel>
inline void decode_tile_block(const uint8_t* blk, TileBlock& t) {
  __m512i pair[4];  // rows 2p and 2p + 1, as pair_codes lays them out
  for (int p = 0; p < 4; ++p) {
    const uint8_t* r0 = blk + 2 * p * Kernel::kBytes;
    if constexpr (std::is_same_v<Kernel, Q8_0Kernel>) {  // codes q + 128, unsigned
      pair[p] = _mm512_xor_si512(pair_of(load32(r0 + 2), load32(r0 + Kernel::kBytes + 2)), _mm512_set1_epi8(-128));
    } else {
      pair[p] = pair_codes<Kernel>(r0);
    }
  }
  interleave_rows(pair, t.codes);
  t.scale = fp16x8_twice(blk + Kernel::kScaleAt, Kernel::kBytes);
  if constexpr (Kernel::kHasMinTerm)
    t.min = _mm512_maskz_mov_ps(0x5555, fp16x8_twice(blk + Kernel::kMinScaleAt, Kernel::kBytes));
}

// Q4_K, Q5_K and Q6_K the same way, a super-block (256 weights) of 8 rows at a time: 32 code vectors as above, and
// per sub-block (8 of 32, or Q6_K's 16 of 16) its 8 rows' integer scales, which multiply the sub-block's dot
// products (vpmulld) before they are summed over the super-block. The term the activations' sub-block sums carry
// (the K-quants' mins, Q6_K's offset 32 times its scales) is one int16-pair dot product (vpdpwssd) per 4 sub-blocks:
// lane 2r + t holds row r's values for sub-blocks 4u + 2t and 4u + 2t + 1, against the broadcast sums of 4u .. 4u + 3.
struct TileSuperBlock {
  __m512i codes[32];                   // vector q: qword r = row r's codes 8q..8q+7
  alignas(64) int32_t scales[16][16];  // sub-block s: lanes 2r, 2r + 1 = row r's scale
  alignas(64) int32_t pairs[4][16];    // lane 2r + t of u: row r's (mins or scales) 4u + 2t, 4u + 2t + 1 as int16
  __m512 d, dmin;                      // lanes 2r, 2r + 1: row r's d (dmin: Q4_K, Q5_K)
};

// Each 8 rows' scale bytes in dwords, 4 rows a vector (row r at dword 4 (r % 4) + i of vector r / 4): Q4_K, Q5_K's
// unpacked scales (dwords 0, 1) and mins (2, 3) as unsigned bytes, Q6_K's 16 signed scales as they lie.
template <typename Kernel>
inline void scale_dwords_8rows(const uint8_t* blk, __m512i* four_rows) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* rows = blk + 4 * h * Kernel::kBytes;
    if constexpr (std::is_same_v<Kernel, Q6_KKernel>) {
      four_rows[h] = kquant512::bytes16_of_4rows(rows + 192, Kernel::kBytes);
    } else {
      four_rows[h] = kquant512::unpack_scales_4rows(rows, Kernel::kBytes);
    }
  }
}

// dword i of rows 0-7 (from scale_dwords_8rows' two vectors) -> lane l = that dword of the row whose dword 0 is
// at row_dwords[l] of the pair (4 (r % 4), plus 16 for rows 4-7)
inline __m512i pick_dword(const __m512i* four_rows, __m512i row_dwords, int i) {
  return _mm512_permutex2var_epi32(four_rows[0], _mm512_add_epi32(row_dwords, _mm512_set1_epi32(i)), four_rows[1]);
}

// byte b of every dword as an int32, zero- or sign-extended
template <bool Signed>
inline __m512i byte_of_dwords(__m512i v, int b) {
  if constexpr (Signed) return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * b), 24);
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * b), _mm512_set1_epi32(0xFF));
}

// bytes 0 and 1 of every dword as an int16 pair (low, high), zero- or sign-extended
template <bool Signed>
inline __m512i int16_pair_of_dwords(__m512i v) {
  if constexpr (Signed)
    return _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), _mm512_set1_epi32(0xFFFF)),
                           _mm512_slli_epi32(_mm512_srai_epi16(v, 8), 16));
  return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xFF)),
                         _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0xFF00)), 8));
}

// The K-quants' 32-code chunks (chunk c: weights 32c .. 32c + 31) from packed bytes, each decoded in whatever
// layout `bytes` returns them in (rows transposed into lanes), so a chunk of 8 or 16 rows costs a few vector ops:
// bytes(offset) transposes the rows' 32 bytes at that offset into Width code vectors, and emit(c, v) takes chunk c.
// Q4_K / Q5_K: the low and high nibbles of qs[32k ..] are chunks 2k and 2k + 1, Q5_K's fifth bit of chunk c is bit
// c of qh[l]. Q6_K: half n's ql[64n ..] nibbles and qh[32n ..] bit pairs 0-1, 2-3, 4-5, 6-7 give chunks 4n .. 4n + 3
// (ggml's dequantize_row_q6_K order).
template <typename Kernel, int Width, typename Bytes, typename Emit>
inline void decode_chunks(Bytes bytes, Emit emit) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  auto nibble = [&](__m512i v, int high) { return _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, low4); };
  __m512i v[Width], lo[Width], hi[Width];
  if constexpr (std::is_same_v<Kernel, Q6_KKernel>) {
    const __m512i low2 = _mm512_set1_epi8(0x03);
    for (int n = 0; n < 2; ++n) {
      __m512i qh[Width];
      bytes(128 + 32 * n, qh);
      bytes(64 * n, lo);
      bytes(64 * n + 32, hi);
      for (int q = 0; q < 4; ++q) {
        const __m512i* ql = q % 2 ? hi : lo;
        for (int j = 0; j < Width; ++j) {
          const __m512i top = _mm512_and_si512(_mm512_srli_epi16(qh[j], 2 * q), low2);
          v[j] = _mm512_or_si512(nibble(ql[j], q / 2), _mm512_slli_epi16(top, 4));
        }
        emit(4 * n + q, v);
      }
    }
  } else {
    __m512i qh[Width];
    if constexpr (Kernel::kType == kQ5_K) bytes(16, qh);
    for (int k = 0; k < 4; ++k) {
      bytes(Kernel::kQs + 32 * k, v);
      for (int half = 0; half < 2; ++half) {
        const int c = 2 * k + half;
        for (int j = 0; j < Width; ++j) {
          lo[j] = nibble(v[j], half);
          if constexpr (Kernel::kType == kQ5_K)  // nibbles have no bit 4: adding it sets it
            lo[j] = _mm512_mask_add_epi8(lo[j], _mm512_test_epi8_mask(qh[j], _mm512_set1_epi8(char(1 << c))), lo[j],
                                         _mm512_set1_epi8(0x10));
        }
        emit(c, lo);
      }
    }
  }
}

// 8 rows' 32 bytes at p + r * stride -> out[j]: qword r = row r's bytes 8j .. 8j + 7
inline void transpose_8x32(const uint8_t* p, int64_t stride, __m512i* out) {
  __m512i pair[4];
  for (int q = 0; q < 4; ++q) pair[q] = pair_of(load32(p + 2 * q * stride), load32(p + (2 * q + 1) * stride));
  interleave_rows(pair, out);
}

template <typename Kernel>
inline void decode_tile_block(const uint8_t* blk, TileSuperBlock& t) {
  constexpr bool kQ6 = std::is_same_v<Kernel, Q6_KKernel>;
  decode_chunks<Kernel, 4>([&](int offset, __m512i* out) { transpose_8x32(blk + offset, Kernel::kBytes, out); },
                           [&](int c, const __m512i* v) {
                             for (int j = 0; j < 4; ++j) t.codes[4 * c + j] = v[j];
                           });
  __m512i four_rows[2];
  scale_dwords_8rows<Kernel>(blk, four_rows);
  const __m512i row_dwords = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);  // 2r, 2r + 1
  for (int i = 0; i < (kQ6 ? 4 : 2); ++i) {  // the scales' dwords
    const __m512i dw = pick_dword(four_rows, row_dwords, i);
    for (int b = 0; b < 4; ++b) _mm512_store_si512(t.scales[4 * i + b], byte_of_dwords<kQ6>(dw, b));
  }
  // pair u, lane 2r + t: values 4u + 2t, 4u + 2t + 1 of row r (the mins from dword 2, or Q6_K's scales)
  const __m512i odd_lanes_high = _mm512_setr_epi32(0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16);
  for (int u = 0; u < (kQ6 ? 4 : 2); ++u)
    _mm512_store_si512(t.pairs[u], int16_pair_of_dwords<kQ6>(
                                       _mm512_srlv_epi32(pick_dword(four_rows, row_dwords, (kQ6 ? 0 : 2) + u),
                                                         odd_lanes_high)));
  t.d = fp16x8_twice(blk + Kernel::kScaleAt, Kernel::kBytes);
  t.dmin = kQ6 ? _mm512_setzero_ps() : fp16x8_twice(blk + Kernel::kMinScaleAt, Kernel::kBytes);
}

// 8 or 4 activation codes from p in every qword or dword of a vector (the sweeps' broadcast operand)
inline __m512i broadcast_qword(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}
inline __m512i broadcast_dword(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A decoded super-block against one activation row, once its sub-blocks' scaled sums are in isum: the mins (or
// Q6_K's offset) and d, in the 16 lanes (lanes 2r, 2r + 1: row r)
template <typename Kernel>
inline __m512 finish_superblock(const TileSuperBlock& t, const ActQ8_K& a, __m512i isum) {
  __m512i pairs = _mm512_setzero_si512();
  if constexpr (std::is_same_v<Kernel, Q6_KKernel>) {
    for (int u = 0; u < 4; ++u)  // sum_j sc[j] bsums[j], taken 32 times: the codes' offset
      pairs = _mm512_dpwssd_epi32(pairs, _mm512_load_si512(t.pairs[u]), broadcast_qword(a.bsums + 4 * u));
    isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(pairs, 5));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(t.d, _mm512_set1_ps(a.d)));
  } else {
    for (int u = 0; u < 2; ++u)  // sum_s m[s] bsums32[s]
      pairs = _mm512_dpwssd_epi32(pairs, _mm512_load_si512(t.pairs[u]), broadcast_qword(a.bsums32 + 4 * u));
    const __m512 da = _mm512_set1_ps(a.d);
    return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(pairs), _mm512_mul_ps(t.dmin, da),
                            _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(t.d, da)));
  }
}

// R activation rows (row i's block at act[i * nb]) against one decoded super-block of 8 rows, 32 codes of each row
// at a time, their 4 code vectors held in registers for all R rows (as tile16_rows, below): lanes as
// finish_superblock's
template <typename Kernel, int R>
inline void superblock_rows(const TileSuperBlock& t, const ActQ8_K* act, int64_t nb, __m512* acc) {
  __m512i isum[R];
  for (int i = 0; i < R; ++i) isum[i] = _mm512_setzero_si512();
  for (int s = 0; s < 8; ++s) {  // code vectors 4s .. 4s + 3: a sub-block of 32, or Q6_K's sub-blocks 2s, 2s + 1
    __m512i c[4];
    for (int j = 0; j < 4; ++j) c[j] = t.codes[4 * s + j];
    for (int i = 0; i < R; ++i) {
      const int8_t* qs = act[i * nb].qs + 32 * s;
      if constexpr (std::is_same_v<Kernel, Q6_KKernel>) {
        const __m512i zero = _mm512_setzero_si512();
        const __m512i p0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, c[0], broadcast_qword(qs)), c[1],
                                               broadcast_qword(qs + 8));
        const __m512i p1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, c[2], broadcast_qword(qs + 16)), c[3],
                                               broadcast_qword(qs + 24));
        const __m512i scaled = _mm512_add_epi32(_mm512_mullo_epi32(p0, _mm512_load_si512(t.scales[2 * s])),
                                                _mm512_mullo_epi32(p1, _mm512_load_si512(t.scales[2 * s + 1])));
        isum[i] = _mm512_add_epi32(isum[i], scaled);
      } else {
        __m512i p = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) p = _mm512_dpbusd_epi32(p, c[j], broadcast_qword(qs + 8 * j));
        isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(p, _mm512_load_si512(t.scales[s])));
      }
    }
  }
  for (int i = 0; i < R; ++i) acc[i] = _mm512_add_ps(acc[i], finish_superblock<Kernel>(t, act[i * nb], isum[i]));
}

// acc + a block's integer sums (lanes as the tile lays its rows out) times the rows' d and the activation's d, plus
// Q4_1's min term
template <typename Kernel, typename Tile>
inline __m512 add_scaled_block(__m512 acc, __m512i sums, const Tile& t, const ActQ8_0& a) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(t.scale, _mm512_set1_ps(a.d)), acc);
  if constexpr (Kernel::kHasMinTerm)
    acc = _mm512_fmadd_ps(t.min, _mm512_set1_ps(a.d * static_cast<float>(a.sum)), acc);
  return acc;
}

// R activation rows (block b of row i at act[i * nb + b], its starting value at start[i * nb + b]) against one
// decoded group: res[i][r] = row r . activation row i
template <typename Kernel, int R, typename TileOf>
void tile_rows(TileOf tile_of, int64_t nb, const typename Kernel::Act* act, const int64_t* start,
               float (*res)[8]) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const auto& t = tile_of(b);
    if constexpr (Kernel::kBlock == 256) {
      superblock_rows<Kernel, R>(t, act + b, nb, acc);
    } else {
      for (int i = 0; i < R; ++i) {
        const ActQ8_0& a = act[i * nb + b];
        __m512i s = _mm512_set1_epi64(start[i * nb + b]);
        for (int j = 0; j < 4; ++j) s = _mm512_dpbusd_epi32(s, t.codes[j], broadcast_qword(a.qs + 8 * j));
        acc[i] = add_scaled_block<Kernel>(acc[i], s, t, a);
      }
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int i = 0; i < R; ++i) {
    const __m512 pairs = _mm512_add_ps(acc[i], _mm512_permute_ps(acc[i], 0xB1));  // lane 2r: row r's two lanes
    _mm256_storeu_ps(res[i], _mm512_castps512_ps256(_mm512_permutexvar_ps(even, pairs)));
  }
}

// From 16 activation rows the 32-blocks go 16 weight rows at a time, one row per int32 lane: vector q holds quad q
// (codes 4q..4q+3) of 16 rows, and an activation row's quad q, broadcast, meets them in one vpdpbusd. Per
// activation row and block that is 8 dot products, one conversion and one fma for 16 rows, against 4 + 1 + 1 for 8
// rows above; the lanes need no pair sum at the end, and the offset is -off x the block's sum.
struct TileBlock16 {
  __m512i codes[8];  // vector q: lane r = row r's codes 4q..4q+3
  __m512 scale;      // lane r: row r's d
  __m512 min;        // Q4_1: lane r: row r's m
};

// 16 rows' 32 codes (a 256-bit vector each) -> out[q]: lane r = dword q of row r
inline void transpose_16x8(const __m256i* rows, __m512i* out) {
  __m512i z[8], t[8], u[8];
  for (int r = 0; r < 8; ++r) z[r] = _mm512_inserti64x4(_mm512_castsi256_si512(rows[r]), rows[r + 8], 1);
  for (int k = 0; k < 4; ++k) {  // 128-bit lanes: dwords 0..3 / 4..7 of rows 2k, 2k + 1 interleaved
    t[2 * k] = _mm512_unpacklo_epi32(z[2 * k], z[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(z[2 * k], z[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h + 3 (and 8 + those in the upper half): dword d in 128-bit lane
    const __m512i* th = t + 4 * h;
    u[4 * h + 0] = _mm512_unpacklo_epi64(th[0], th[2]);  // d = 0 (lanes 0, 2), 4 (lanes 1, 3)
    u[4 * h + 1] = _mm512_unpackhi_epi64(th[0], th[2]);  // 1, 5
    u[4 * h + 2] = _mm512_unpacklo_epi64(th[1], th[3]);  // 2, 6
    u[4 * h + 3] = _mm512_unpackhi_epi64(th[1], th[3]);  // 3, 7
  }
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int d = 0; d < 4; ++d) {
    out[d] = _mm512_permutex2var_epi64(u[d], low, u[4 + d]);
    out[d + 4] = _mm512_permutex2var_epi64(u[d], high, u[4 + d]);
  }
}

// the fp16 at offset `at` of the 8 rows of g0 (lanes 0-7) and of g1 (lanes 8-15), rows ld bytes apart
inline __m512 fp16x16(const uint8_t* g0, const uint8_t* g1, int64_t at, int64_t ld) {
  const __m256 lo = fp16x8(g0 + at, ld), hi = fp16x8(g1 + at, ld);
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// rows: 16 weight rows' block b, rows 0-7 from one group of the decode layout and 8-15 from the next
template <typename Kernel>
inline void decode_tile_block16(const uint8_t* g0, const uint8_t* g1, TileBlock16& t) {
  __m256i rows[16];
  for (int r = 0; r < 16; ++r) {
    const uint8_t* blk = (r < 8 ? g0 : g1) + (r % 8) * Kernel::kBytes;
    if constexpr (std::is_same_v<Kernel, Q8_0Kernel>)
      rows[r] = _mm256_xor_si256(load32(blk + 2), _mm256_set1_epi8(-128));  // q + 128, unsigned
    else
      rows[r] = Avx2Kernel<Kernel>::decode(blk).q;
  }
  transpose_16x8(rows, t.codes);
  t.scale = fp16x16(g0, g1, Kernel::kScaleAt, Kernel::kBytes);
  if constexpr (Kernel::kHasMinTerm)
    t.min = fp16x16(g0, g1, Kernel::kMinScaleAt, Kernel::kBytes);
}

template <typename Kernel, int R, typename TileOf>
std::enable_if_t<std::is_same_v<typename Kernel::Act, ActQ8_0>> tile16_rows(TileOf tile_of, int64_t nb,
                                                                           const ActQ8_0* act, float (*res)[16]) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const TileBlock16& t = tile_of(b);
    for (int i = 0; i < R; ++i) {
      const ActQ8_0& a = act[i * nb + b];
      // two chains of dot products, not one of 8: Q5_0 [9728, 896] at 32 / 512 rows 0.541-0.561 / 6.86-7.15 ms
      // -> 0.523-0.526 / 6.42-7.08, alternating builds (the integer sums, so the results, are the same)
      __m512i s = _mm512_set1_epi32(-kTileOffset<Kernel> * a.sum), s1 = _mm512_setzero_si512();
      for (int q = 0; q < 8; q += 2) {
        s = _mm512_dpbusd_epi32(s, t.codes[q], broadcast_dword(a.qs + 4 * q));
        s1 = _mm512_dpbusd_epi32(s1, t.codes[q + 1], broadcast_dword(a.qs + 4 * q + 4));
      }
      acc[i] = add_scaled_block<Kernel>(acc[i], _mm512_add_epi32(s, s1), t, a);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(res[i], acc[i]);
}

// The K-quants 16 weight rows at a time, one row per int32 lane as TileBlock16: a super-block's 64 quads in 64
// vectors, each sub-block's dot products (8 of 32 or Q6_K's 16 of 16: 8 or 4 vpdpbusd) scaled by one vpmulld for
// all 16 rows (the 8-row tiles need one per 8 rows, and a pair sum per row at the end), the mins (or Q6_K's offset)
// by vpdpwssd on int16 pairs: lane r of u holds row r's values 2u, 2u + 1 against the broadcast sums 2u, 2u + 1.
// [896, 4864], 2 threads, ms at 16 / 32 / 64 / 128 rows, 8-row tiles -> these: Q6_K 0.43 / 0.64 / 1.12 / 2.03 ->
// 0.40 / 0.51 / 0.92 / 1.77, Q4_K 0.27 / 0.45 / 0.88 / 1.59 -> 0.26 / 0.44 / 0.79 / 1.54 (less than the 32-blocks
// gained: each super-block of 16 rows takes 8 transposes and 16 row decodes per call).
struct TileSuperBlock16 {
  __m512i codes[64];   // vector q: lane r = row r's codes 4q..4q+3
  __m512i scales[16];  // sub-block s: lane r = row r's scale (Q4_K, Q5_K: the first 8)
  __m512i pairs[8];    // u: lane r = row r's mins (Q6_K: scales) 2u, 2u + 1 as int16 (Q4_K, Q5_K: the first 4)
  __m512 d, dmin;      // lane r: row r's d (dmin: Q4_K, Q5_K)
};

template <typename Kernel>
inline void decode_tile_block16(const uint8_t* g0, const uint8_t* g1, TileSuperBlock16& t) {
  constexpr bool kQ6 = std::is_same_v<Kernel, Q6_KKernel>;
  auto row = [&](int r) { return (r < 8 ? g0 : g1) + (r % 8) * Kernel::kBytes; };
  decode_chunks<Kernel, 8>(
      [&](int offset, __m512i* out) {
        __m256i rows[16];
        for (int r = 0; r < 16; ++r) rows[r] = load32(row(r) + offset);
        transpose_16x8(rows, out);
      },
      [&](int c, const __m512i* v) {
        for (int q = 0; q < 8; ++q) t.codes[8 * c + q] = v[q];
      });
  // lanes 0-7 from g0's rows, 8-15 from g1's
  __m512i first[2], second[2];
  scale_dwords_8rows<Kernel>(g0, first);
  scale_dwords_8rows<Kernel>(g1, second);
  const __m512i row_dwords = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  auto dword = [&](int i) {
    return _mm512_mask_blend_epi32(0xFF00, pick_dword(first, row_dwords, i), pick_dword(second, row_dwords, i));
  };
  for (int i = 0; i < (kQ6 ? 4 : 2); ++i) {
    const __m512i dw = dword(i);
    for (int b = 0; b < 4; ++b) t.scales[4 * i + b] = byte_of_dwords<kQ6>(dw, b);
  }
  // pair u, lane r: values 2u, 2u + 1 of row r (the mins from dword 2, or Q6_K's scales)
  for (int u = 0; u < (kQ6 ? 8 : 4); ++u)
    t.pairs[u] = int16_pair_of_dwords<kQ6>(_mm512_srli_epi32(dword((kQ6 ? 0 : 2) + u / 2), 16 * (u % 2)));
  t.d = fp16x16(g0, g1, Kernel::kScaleAt, Kernel::kBytes);
  t.dmin = kQ6 ? _mm512_setzero_ps() : fp16x16(g0, g1, Kernel::kMinScaleAt, Kernel::kBytes);
}

// A super-block of 16 rows against one activation row, once its sub-blocks' scaled sums are in isum: the mins (or
// Q6_K's offset) and d. Lane r = row r's sum.
template <typename Kernel>
inline __m512 finish_superblock16(const TileSuperBlock16& t, const ActQ8_K& a, __m512i isum) {
  __m512i pairs = _mm512_setzero_si512();
  const __m512 da = _mm512_set1_ps(a.d);
  if constexpr (std::is_same_v<Kernel, Q6_KKernel>) {
    for (int u = 0; u < 8; ++u)  // sum_j sc[j] bsums[j], taken 32 times: the codes' offset
      pairs = _mm512_dpwssd_epi32(pairs, t.pairs[u], broadcast_dword(a.bsums + 2 * u));
    isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(pairs, 5));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(t.d, da));
  } else {
    for (int u = 0; u < 4; ++u)  // sum_s m[s] bsums32[s]
      pairs = _mm512_dpwssd_epi32(pairs, t.pairs[u], broadcast_dword(a.bsums32 + 2 * u));
    return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(pairs), _mm512_mul_ps(t.dmin, da),
                            _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(t.d, da)));
  }
}

// R activation rows against decoded super-blocks of 16 rows, 32 codes of each row at a time: their 8 code vectors
// stay in registers while all R rows meet them, so a vpdpbusd loads only its broadcast activation quad. Each row
// reloading all 64 code vectors of a super-block made two loads per vpdpbusd, the limit at 600-700 GFLOP/s (the
// 32-blocks, whose 8 vectors a block fit in registers, reach 1100-1250). The integer sums are the same, so are the
// results, bit for bit.
template <typename Kernel, int R, typename TileOf>
std::enable_if_t<std::is_same_v<typename Kernel::Act, ActQ8_K>> tile16_rows(TileOf tile_of, int64_t nb,
                                                                           const ActQ8_K* act, float (*res)[16]) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const TileSuperBlock16& t = tile_of(b);
    __m512i isum[R];
    for (int i = 0; i < R; ++i) isum[i] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {  // quads 8s .. 8s + 7: a sub-block of 32, or Q6_K's sub-blocks 2s and 2s + 1
      __m512i c[8];
      for (int q = 0; q < 8; ++q) c[q] = t.codes[8 * s + q];
      for (int i = 0; i < R; ++i) {
        const int8_t* qs = act[i * nb + b].qs + 32 * s;
        if constexpr (std::is_same_v<Kernel, Q6_KKernel>) {
          __m512i p0 = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
          for (int q = 0; q < 4; ++q) {
            p0 = _mm512_dpbusd_epi32(p0, c[q], broadcast_dword(qs + 4 * q));
            p1 = _mm512_dpbusd_epi32(p1, c[4 + q], broadcast_dword(qs + 16 + 4 * q));
          }
          isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(p0, t.scales[2 * s]),
                                                               _mm512_mullo_epi32(p1, t.scales[2 * s + 1])));
        } else {
          __m512i p = _mm512_setzero_si512();
          for (int q = 0; q < 8; ++q) p = _mm512_dpbusd_epi32(p, c[q], broadcast_dword(qs + 4 * q));
          isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(p, t.scales[s]));
        }
      }
    }
    for (int i = 0; i < R; ++i)
      acc[i] = _mm512_add_ps(acc[i], finish_superblock16<Kernel>(t, act[i * nb + b], isum[i]));
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(res[i], acc[i]);
}

// The starting values: per activation block, -off x (its sums over quads 0, 2, 4, 6 and over 1, 3, 5, 7), as the
// low and high int32 of one int64 (the lanes 2r and 2r + 1 it is broadcast to)
inline int64_t tile_start(const ActQ8_0& a, int32_t off) {
  const uint32_t lo = static_cast<uint32_t>(-off * a.quad_sums[0]), hi = static_cast<uint32_t>(-off * a.quad_sums[1]);
  return static_cast<int64_t>((static_cast<uint64_t>(hi) << 32) | lo);
}

// the kernel types the tile kernels take
template <typename Kernel>
constexpr bool kTiles = false;
template <int64_t Type>
constexpr bool kTiles<LegacyUnsigned<Type>> = true;
template <>
constexpr bool kTiles<Q8_0Kernel> = true;
template <int64_t Type>
constexpr bool kTiles<KQuant45<Type>> = true;
template <>
constexpr bool kTiles<Q6_KKernel> = true;

// below this many activation rows the decode kernels stream the weights faster. Since the K-quant sweeps hold a
// sub-block's codes in registers they pay from 4 rows as the 32-blocks' do: Q6_K [896, 4864] at 4 / 5 / 7 rows
// 0.145 / 0.140 / 0.156 ms in tiles, 0.139 / 0.180 / 0.235 in dot8
constexpr int64_t kTileMinRows = 4;
constexpr int kTileRows = 16;        // activation rows per pass over a decoded group (their sums stay in registers)

// out[M, N] (N a multiple of 16) from weights in the decode layout, 16 rows at a time: TileBlock16 for the
// 32-blocks, TileSuperBlock16 for the K-quants. Decoding as they sweep (sweep_tiles), 4-16 rows of weights streamed
// from memory take 0.5-0.8x the time that decoding first took (docs/performance.md, Kernels).
template <typename Kernel, typename T>
void mm_tiles16(T* out, int64_t ldo, int64_t levels, const typename Kernel::Act* act, int64_t M, int64_t nb,
                const Layout& w, int64_t N, const float* bias) {
  using Tile = std::conditional_t<Kernel::kBlock == 256, TileSuperBlock16, TileBlock16>;
  sweep_tiles<Tile, 16, kTileRows, Kernel::kBytes>(
      out, ldo, levels, M, nb, w, N, bias,
      [&](const uint8_t* rows, int64_t at, Tile& t) {
        decode_tile_block16<Kernel>(rows + at, rows + 8 * w.ld + at, t);
      },
      [&](auto count, const auto& tile_of, int64_t m0, float (*res)[16]) {
        tile16_rows<Kernel, count()>(tile_of, nb, act + m0 * nb, res);
      });
}

// mm_tiles16 for N not a multiple of 16: a group of 8 rows at a time, in the 8-row tiles (TileBlock, TileSuperBlock)
template <typename Kernel, typename T>
void mm_tiles(T* out, int64_t ldo, int64_t levels, const typename Kernel::Act* act, int64_t M, int64_t nb,
              const Layout& w, int64_t N, const float* bias) {
  using Tile = std::conditional_t<Kernel::kBlock == 256, TileSuperBlock, TileBlock>;
  std::vector<int64_t> start;  // the 32-blocks' starting values (the K-quants need none)
  if constexpr (Kernel::kBlock == 32) {
    start.resize(static_cast<size_t>(M * nb));
    for (int64_t k = 0; k < M * nb; ++k) start[k] = tile_start(act[k], kTileOffset<Kernel>);
  }
  sweep_tiles<Tile, 8, kTileRows, Kernel::kBytes>(
      out, ldo, levels, M, nb, w, N, bias,
      [&](const uint8_t* rows, int64_t at, Tile& t) { decode_tile_block<Kernel>(rows + at, t); },
      [&](auto count, const auto& tile_of, int64_t m0, float (*res)[8]) {
        tile_rows<Kernel, count()>(tile_of, nb, act + m0 * nb, start.empty() ? nullptr : start.data() + m0 * nb,
                                   res);
      });
}

}  // namespace qwenserve::cpu::ggml::x86

#endif  // QS_X86_AVX512_VNNI

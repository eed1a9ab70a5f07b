// The ggml kernels on AVX-512 (F and BW, on top of AVX2): the q8_0 activation quantizer 16 lanes wide, and the
// 512-bit decode kernels (one group of 8 weight rows of the decode layout against 1 or 2 activation rows): the
// 32-blocks with 4-bit codes (dot8_legacy512), which keeps two weight rows in one vector, and the K-quants
// (dot8_kquant512), which keeps 64 codes of one row in one vector.
#pragma once

#include <cstdint>
#include <cstring>

#include "arch/x86/avx2.h"
#include "cpu_features.h"
#include "ggml/common.h"

#if QS_X86_AVX512BW

namespace qwenserve::cpu::ggml::x86 {

// quantize_row_q8_0 16 lanes at a time, with the same operations (so the same codes and scales): |x| max, d =
// amax / 127, codes round(x / d) half away from zero, as std::round
inline __m512 round_half_away(__m512 p) {
  const __m512 t = _mm512_roundscale_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m512 away = _mm512_or_ps(_mm512_and_ps(p, _mm512_set1_ps(-0.0f)), _mm512_set1_ps(1.0f));  // +-1
  const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(p, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
  return _mm512_mask_add_ps(t, up, t, away);
}

template <typename T>
void quantize_block_q8_0_512(const T* x, ActQ8_0& y) {
  const __m512 v0 = load16(x), v1 = load16(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.0f;
  const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m512i q0 = _mm512_cvtps_epi32(round_half_away(_mm512_mul_ps(v0, id)));
  const __m512i q1 = _mm512_cvtps_epi32(round_half_away(_mm512_mul_ps(v1, id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y.qs), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y.qs + 16), _mm512_cvtepi32_epi8(q1));
  const __m512i both = _mm512_add_epi32(q0, q1);  // lanes 0-3 and 8-11 hold even quads of both halves
  y.sum = _mm512_reduce_add_epi32(both);
  y.quad_sums[0] = _mm512_mask_reduce_add_epi32(0x0F0F, both);
  y.quad_sums[1] = y.sum - y.quad_sums[0];
  y.d = static_cast<float>(c10::Half(d));
}

template <typename T>
void quantize_row_q8_0(const T* x, int64_t nb, ActQ8_0* y) {
  for (int64_t b = 0; b < nb; ++b) quantize_block_q8_0_512(x + 32 * b, y[b]);
}

// The codes of two consecutive rows' blocks (r0 at p, r1 at p + kBytes) in one vector of 64 bytes. 128-bit
// lanes: r0's codes 0..15, r1's 0..15, r0's 16..31, r1's 16..31 (for Q4_0, Q4_1, Q5_0: r0's packed bytes, r1's,
// r0's, r1's, then the low nibbles kept in lanes 0-1 and the high nibbles in lanes 2-3).
template <typename Kernel>
inline __m512i pair_codes(const uint8_t* r0) {
  const uint8_t* r1 = r0 + Kernel::kBytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  __m512i q = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + Kernel::kQs)));
  q = _mm512_mask_broadcast_i32x4(q, 0xF0F0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + Kernel::kQs)));
  q = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFFFF0000u, q, 4), low4);
  if constexpr (Kernel::kOff == 16) {  // Q5_0: code byte j of the vector gets 16 where its fifth bit is set
    uint32_t h0, h1;
    std::memcpy(&h0, r0 + 2, 4);
    std::memcpy(&h1, r1 + 2, 4);
    const uint64_t low_halves = (h0 & 0xFFFFu) | (h1 << 16), high_halves = (h0 >> 16) | (h1 & 0xFFFF0000u);
    q = _mm512_mask_add_epi8(q, static_cast<__mmask64>(low_halves | (high_halves << 32)), q, fifth);
  }
  return q;
}

// Q4_0, Q4_1 and Q5_0 in the decode layout, 512 bits wide. Where dot8 reduces every block's 8 rows to 8 lanes
// (a hadd tree per block), this keeps each row's partial sums in float lanes across all blocks and reduces once per
// row at the end: per pair of rows and block, one vector of 64 codes (the pair's blocks, their nibbles split by one
// masked shift), Q5_0's fifth bits added under a 64-bit mask, one u8 x s8 dot product against the activation block
// (duplicated to match), and one fma with the two rows' scales. The offsets (-8, -16) and Q4_1's min term are one
// 8-row fma per block. Measured at one activation row on 2 AVX-512 cores without VNNI (Xeon, 2.0 GHz): Q5_0
// [9728, 896] 1.15 ms with dot8, 0.71 ms with this.
template <typename Kernel, int R>
void dot8_legacy512(const uint8_t* w, int64_t nb, const ActQ8_0* const* y, float (*res)[8]) {
  constexpr int64_t kAhead = 4096, kGroupBytes = 8 * Kernel::kBytes;
  // the 4 lanes of 4 int32 that pair p's dot product gives: rows 2p, 2p + 1, 2p, 2p + 1 -> their scales' index
  __m512i scale_index[4];
  for (int p = 0; p < 4; ++p) {
    const __m128i lo = _mm_set1_epi32(2 * p), hi = _mm_set1_epi32(2 * p + 1);
    scale_index[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(hi, lo)),
                                        _mm256_set_m128i(hi, lo), 1);
  }
  __m512 acc[R][4];
  __m256 extra[R];  // per row: the offsets' or Q4_1's min term
  for (int i = 0; i < R; ++i) {
    extra[i] = _mm256_setzero_ps();
    for (int p = 0; p < 4; ++p) acc[i][p] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kGroupBytes;
    for (int64_t line = 0; line < kGroupBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + line), _MM_HINT_T0);
    const __m256 d = fp16x8(blk + Kernel::kScaleAt, Kernel::kBytes);
    __m512i act[R];
    __m512 row_scale[R];  // lanes 0..7: d of row r times the activation block's d
    for (int i = 0; i < R; ++i) {
      const ActQ8_0& a = y[i][b];
      const __m512i t = _mm512_castsi256_si512(load32(a.qs));
      act[i] = _mm512_shuffle_i64x2(t, t, 0x50);  // 128-bit lanes: a[0:16], a[0:16], a[16:32], a[16:32]
      row_scale[i] = _mm512_castps256_ps512(_mm256_mul_ps(d, _mm256_set1_ps(a.d)));
      if constexpr (Kernel::kHasMinTerm)
        extra[i] = _mm256_fmadd_ps(fp16x8(blk + Kernel::kMinScaleAt, Kernel::kBytes),
                                   _mm256_set1_ps(a.d * static_cast<float>(a.sum)), extra[i]);
      else
        extra[i] = _mm256_fmadd_ps(d, _mm256_set1_ps(-a.d * static_cast<float>(Kernel::kOff * a.sum)), extra[i]);
    }
    for (int p = 0; p < 4; ++p) {
      const __m512i q = pair_codes<Kernel>(blk + 2 * p * Kernel::kBytes);
      for (int i = 0; i < R; ++i) {
#if QS_X86_AVX512_VNNI
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, act[i]);
#else
        const __m512i s = _mm512_madd_epi16(_mm512_maddubs_epi16(q, act[i]), _mm512_set1_epi16(1));
#endif
        acc[i][p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(scale_index[p], row_scale[i]), _mm512_cvtepi32_ps(s),
                                    acc[i][p]);
      }
    }
  }
  const __m256i row_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < R; ++i) {
    __m256 half[4];  // pair p: lanes 0-3 row 2p's partial sums, 4-7 row 2p + 1's
    for (int p = 0; p < 4; ++p)
      half[p] = _mm256_add_ps(_mm512_castps512_ps256(acc[i][p]),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i][p]), 1)));
    // hadd of hadds: lanes 0..7 = rows 0, 2, 4, 6, 1, 3, 5, 7
    const __m256 rows = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
    _mm256_storeu_ps(res[i], _mm256_add_ps(_mm256_permutevar8x32_ps(rows, row_order), extra[i]));
  }
}

// The K-quants in the decode layout, 512 bits wide (dot8_kquant512). Per row and super-block, four vectors of 64
// codes (their bytes 0..63 meet activation vectors act[0..3]), one u8 x s8 multiply into int16 pairs and one
// multiply-add by the sub-blocks' scales (int16 words, one per pair) each. The 8 rows' int32 sums are folded into
// one vector (lanes 4j, 4j + 1: row j; 4j + 2, 4j + 3: row 4 + j) before the one fma with their d times the
// activation's d, and each row is reduced once, at the end. Measured at one activation row (two codes, bf16) on 2
// Ice Lake cores with the 1.5B shape's weights from memory: Q4_K [17920, 1536] 1.78 ms with dot8, 0.96-1.02 with
// this.
namespace kquant512 {

// the 16 bytes at p + r * stride for r = 0..3, row r in 128-bit lane r
inline __m512i bytes16_of_4rows(const uint8_t* p, int64_t stride) {
  auto at = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + r * stride)); };
  __m512i z = _mm512_castsi128_si512(at(0));
  z = _mm512_inserti32x4(z, at(1), 1);
  z = _mm512_inserti32x4(z, at(2), 2);
  return _mm512_inserti32x4(z, at(3), 3);
}

// rows 0..3 of the 4 at blk (stride bytes apart): their 12 packed scale bytes unpacked (as scales_mins_k) to 16,
// the 8 scales then the 8 mins, one row per 128-bit lane
inline __m512i unpack_scales_4rows(const uint8_t* blk, int64_t stride) {
  const __m512i z = bytes16_of_4rows(blk + 4, stride);
  const __m512i w0 = _mm512_shuffle_epi32(z, _MM_PERM_AAAA), w1 = _mm512_shuffle_epi32(z, _MM_PERM_BBBB),
                w2 = _mm512_shuffle_epi32(z, _MM_PERM_CCCC);
  const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), low4 = _mm512_set1_epi32(0x0f0f0f0f),
                low2 = _mm512_set1_epi32(0x03030303);
  const __m512i u0 = _mm512_and_si512(w0, low6), u2 = _mm512_and_si512(w1, low6);
  const __m512i u1 = _mm512_or_si512(_mm512_and_si512(w2, low4),
                                     _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), low2), 4));
  const __m512i u3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), low4),
                                     _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), low2), 4));
  __m512i u = _mm512_mask_blend_epi32(0x2222, u0, u1);
  u = _mm512_mask_blend_epi32(0x4444, u, u2);
  return _mm512_mask_blend_epi32(0x8888, u, u3);
}

// the 8 int32 sums of 4 rows' 128-bit lanes (each lane's 4 dwords summed), rows 0-3 from lo and 4-7 from hi
inline __m256i lane_sums_8rows(__m512i lo, __m512i hi) {
  lo = _mm512_add_epi32(lo, _mm512_shuffle_epi32(lo, _MM_PERM_BADC));
  lo = _mm512_add_epi32(lo, _mm512_shuffle_epi32(lo, _MM_PERM_CDAB));
  hi = _mm512_add_epi32(hi, _mm512_shuffle_epi32(hi, _MM_PERM_BADC));
  hi = _mm512_add_epi32(hi, _mm512_shuffle_epi32(hi, _MM_PERM_CDAB));
  const __m512i first_dwords = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutex2var_epi32(lo, first_dwords, hi));
}

// two rows' int32 vectors -> one: 128-bit lanes a, a, b, b (each the sum of two of the row's lanes)
inline __m512i fold_pair(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE));
}
// [a, a, b, b] and [c, c, d, d] -> [a, b, c, d]
inline __m512i fold_quad(__m512i ab, __m512i cd) {
  return _mm512_add_epi32(_mm512_shuffle_i64x2(ab, cd, 0x88), _mm512_shuffle_i64x2(ab, cd, 0xDD));
}
// rows 0-3 and 4-7 one per 128-bit lane -> lanes 4j, 4j + 1: row j; 4j + 2, 4j + 3: row 4 + j
inline __m512i fold_oct(__m512i lo, __m512i hi) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(lo, hi), _mm512_unpackhi_epi64(lo, hi));
}

// the 256-bit halves of a vector from two places
inline __m512i halves(const void* lo, const void* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(lo)), load32(hi), 1);
}
// int16 words: `a` in the low 256 bits, `b` in the high
inline __m512i words_by_half(int a, int b) {
  return _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi16(static_cast<int16_t>(a)),
                                 _mm512_set1_epi16(static_cast<int16_t>(b)));
}

// A K-quant type's part: its activation vectors, what a group block shares (Group: the 8 rows' scales), a row's
// codes and scale words (row), its integer offset (kHasOffset: offset, from the scales row() gave) and its float
// term besides d dy isum (add_min_term).
template <typename Kernel>
struct Part;

// Q4_K, Q5_K: code vector v holds sub-blocks kFirst[v] and kFirst[v] + 2 (the low or high nibbles of two chunks);
// the mins' term, -dmin dy sum_s m[s] bsums32[s], is one 8-row fma per block.
template <int64_t Type>
struct Part<KQuant45<Type>> {
  using Kernel = KQuant45<Type>;
  static constexpr int kFirst[4] = {0, 1, 4, 5};
  static void act(const ActQ8_K& a, __m512i* v) {
    for (int k = 0; k < 4; ++k) v[k] = halves(a.qs + 32 * kFirst[k], a.qs + 32 * kFirst[k] + 64);
  }
  struct Constants {
    __m512i low4 = _mm512_set1_epi8(0x0F);
    // code vector v's scale words, zero-extended from the bytes at these positions of a row's unpacked scales
    __m512i scale_pick[4] = {words_by_half(0x8000, 0x8002), words_by_half(0x8001, 0x8003),
                             words_by_half(0x8004, 0x8006), words_by_half(0x8005, 0x8007)};
    __m512i min_pick = _mm512_broadcast_i32x4(_mm_setr_epi8(8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1,
                                                            15, -1));
    // Q5_K: the fifth bit of sub-block s's weight l is bit s of qh[l]
    __m512i fifth_shift[4] = {words_by_half(0, 2), words_by_half(1, 3), words_by_half(4, 6), words_by_half(5, 7)};
  };
  struct Group {
    __m512i sc_lo, sc_hi;  // rows 0-3 and 4-7, unpacked
    alignas(64) uint8_t scales[8][16];
    Group(const uint8_t* blk) {
      sc_lo = unpack_scales_4rows(blk, Kernel::kBytes);
      sc_hi = unpack_scales_4rows(blk + 4 * Kernel::kBytes, Kernel::kBytes);
      _mm512_store_si512(scales[0], sc_lo);
      _mm512_store_si512(scales[4], sc_hi);
    }
  };
  static constexpr bool kHasOffset = false;
  static void row(const Constants& k, const Group& g, const uint8_t* row, int r, __m512i* codes, __m512i* sc,
                  __m256i&) {
    const __m512i bits0 = _mm512_loadu_si512(row + Kernel::kQs), bits1 = _mm512_loadu_si512(row + Kernel::kQs + 64);
    codes[0] = _mm512_and_si512(bits0, k.low4);
    codes[1] = _mm512_and_si512(_mm512_srli_epi16(bits0, 4), k.low4);
    codes[2] = _mm512_and_si512(bits1, k.low4);
    codes[3] = _mm512_and_si512(_mm512_srli_epi16(bits1, 4), k.low4);
    if constexpr (Type == kQ5_K) {
      const __m512i qh = _mm512_broadcast_i64x4(load32(row + 16));
      for (int v = 0; v < 4; ++v) {
        const __m512i bit = _mm512_slli_epi16(_mm512_srlv_epi16(qh, k.fifth_shift[v]), 4);
        codes[v] = _mm512_or_si512(codes[v], _mm512_and_si512(bit, _mm512_set1_epi8(0x10)));
      }
    }
    const __m512i row_scales = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(g.scales[r])));
    for (int v = 0; v < 4; ++v) sc[v] = _mm512_shuffle_epi8(row_scales, k.scale_pick[v]);
  }
  static void add_min_term(const Constants& k, const Group& g, const uint8_t* blk, const ActQ8_K& a, __m256& acc) {
    const __m512i bsums = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bsums32)));
    const __m512i min_lo = _mm512_shuffle_epi8(g.sc_lo, k.min_pick), min_hi = _mm512_shuffle_epi8(g.sc_hi, k.min_pick);
    const __m256i sums = lane_sums_8rows(_mm512_madd_epi16(min_lo, bsums), _mm512_madd_epi16(min_hi, bsums));
    const __m256 dmin = fp16x8(blk + Kernel::kMinScaleAt, Kernel::kBytes);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dmin, _mm256_set1_ps(-a.d)), _mm256_cvtepi32_ps(sums), acc);
  }
};

// Q6_K: per half h, the 64 bytes ql[64h..] give weights 128h + 0..63 (low nibbles) and + 64..127 (high nibbles),
// each with two bits of qh[32h..] (bits 0-1 and 2-3 for the low nibbles of ql[64h..] and ql[64h + 32..], 4-5 and
// 6-7 for the high ones), so the activations are read in order; the 16 scales (int8) are one per 128-bit lane.
// The -32 offset is -32 sum_j sc[j] bsums[j], subtracted in integers.
template <>
struct Part<Q6_KKernel> {
  using Kernel = Q6_KKernel;
  static void act(const ActQ8_K& a, __m512i* v) {
    for (int k = 0; k < 4; ++k) v[k] = _mm512_loadu_si512(a.qs + 64 * k);
  }
  struct Constants {
    __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
    __m512i qh_shift_low = words_by_half(0, 2), qh_shift_high = words_by_half(4, 6);
    // code vector v's scale words: scale 4v + k in 128-bit lane k
    __m512i scale_pick[4] = {
        _mm512_setr_epi32(0, 0, 0, 0, 0x10001, 0x10001, 0x10001, 0x10001, 0x20002, 0x20002, 0x20002, 0x20002,
                          0x30003, 0x30003, 0x30003, 0x30003),
        _mm512_setr_epi32(0x40004, 0x40004, 0x40004, 0x40004, 0x50005, 0x50005, 0x50005, 0x50005, 0x60006, 0x60006,
                          0x60006, 0x60006, 0x70007, 0x70007, 0x70007, 0x70007),
        _mm512_setr_epi32(0x80008, 0x80008, 0x80008, 0x80008, 0x90009, 0x90009, 0x90009, 0x90009, 0xA000A, 0xA000A,
                          0xA000A, 0xA000A, 0xB000B, 0xB000B, 0xB000B, 0xB000B),
        _mm512_setr_epi32(0xC000C, 0xC000C, 0xC000C, 0xC000C, 0xD000D, 0xD000D, 0xD000D, 0xD000D, 0xE000E, 0xE000E,
                          0xE000E, 0xE000E, 0xF000F, 0xF000F, 0xF000F, 0xF000F)};
  };
  struct Group {
    Group(const uint8_t*) {}
  };
  static constexpr bool kHasOffset = true;
  // scales16: the row's 16 scales as int16, for offset
  static void row(const Constants& k, const Group&, const uint8_t* row, int, __m512i* codes, __m512i* sc,
                  __m256i& scales16) {
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(row + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(load32(row + 128 + 32 * h));
      const __m512i top_low = _mm512_and_si512(_mm512_srlv_epi16(qh, k.qh_shift_low), k.low2);
      const __m512i top_high = _mm512_and_si512(_mm512_srlv_epi16(qh, k.qh_shift_high), k.low2);
      codes[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, k.low4), _mm512_slli_epi16(top_low, 4));
      codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), k.low4),
                                         _mm512_slli_epi16(top_high, 4));
    }
    scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 192)));
    for (int v = 0; v < 4; ++v) sc[v] = _mm512_permutexvar_epi16(k.scale_pick[v], _mm512_castsi256_si512(scales16));
  }
  // 32 sum_j sc[j] bsums[j] (the row subtracts it), in the low 256 bits
  static __m512i offset(__m256i scales16, const ActQ8_K& a) {
    return _mm512_castsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(scales16, load32(a.bsums)), 5));
  }
  static void add_min_term(const Constants&, const Group&, const uint8_t*, const ActQ8_K&, __m256&) {}
};

}  // namespace kquant512

template <typename Kernel, int R>
void dot8_kquant512(const uint8_t* w, int64_t nb, const ActQ8_K* const* y, float (*res)[8]) {
  using Part = kquant512::Part<Kernel>;
  // no software read-ahead: on the Zen 4 EPYC (family 25 model 17) 4 KiB ahead made a Qwen3-8B-shaped decode step
  // 1.2-1.3x slower than the hardware prefetchers alone (docs/performance.md, Qwen3 and mixture-of-experts shapes)
  constexpr int64_t kGroupBytes = 8 * Kernel::kBytes;
  const typename Part::Constants k;
  const __m512i folded_row = _mm512_setr_epi32(0, 0, 4, 4, 1, 1, 5, 5, 2, 2, 6, 6, 3, 3, 7, 7);  // lane -> row
  __m512 acc[R];
  __m256 min_term[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm512_setzero_ps();
    min_term[i] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kGroupBytes;
    const typename Part::Group g(blk);
    __m512i act[R][4];
    for (int i = 0; i < R; ++i) Part::act(y[i][b], act[i]);
    // row r's int32 sums against each activation row
    auto row_sums = [&](int r, __m512i* out) {
      const uint8_t* row = blk + r * Kernel::kBytes;
      __m512i codes[4], sc[4];
      __m256i scales16;
      Part::row(k, g, row, r, codes, sc, scales16);
      for (int i = 0; i < R; ++i) {
        __m512i s = _mm512_madd_epi16(_mm512_maddubs_epi16(codes[0], act[i][0]), sc[0]);
        if constexpr (Part::kHasOffset) s = _mm512_sub_epi32(s, Part::offset(scales16, y[i][b]));
        for (int v = 1; v < 4; ++v)
          s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(codes[v], act[i][v]), sc[v]));
        out[i] = s;
      }
    };
    // rows folded as they come, so that few vectors are live: quad[i][h] holds rows 4h..4h + 3
    __m512i quad[R][2];
    for (int h = 0; h < 2; ++h) {
      __m512i pair[2][R];
      for (int p = 0; p < 2; ++p) {
        __m512i first[R], second[R];
        row_sums(4 * h + 2 * p, first);
        row_sums(4 * h + 2 * p + 1, second);
        for (int i = 0; i < R; ++i) pair[p][i] = kquant512::fold_pair(first[i], second[i]);
      }
      for (int i = 0; i < R; ++i) quad[i][h] = kquant512::fold_quad(pair[0][i], pair[1][i]);
    }
    const __m256 d = fp16x8(blk + Kernel::kScaleAt, Kernel::kBytes);
    for (int i = 0; i < R; ++i) {
      const ActQ8_K& a = y[i][b];
      const __m512 row_scale =
          _mm512_permutexvar_ps(folded_row, _mm512_castps256_ps512(_mm256_mul_ps(d, _mm256_set1_ps(a.d))));
      acc[i] = _mm512_fmadd_ps(row_scale, _mm512_cvtepi32_ps(kquant512::fold_oct(quad[i][0], quad[i][1])), acc[i]);
      Part::add_min_term(k, g, blk, a, min_term[i]);
    }
  }
  // lanes 4j and 4j + 2 then hold rows j and 4 + j
  const __m512i row_order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int i = 0; i < R; ++i) {
    const __m512 pairs = _mm512_add_ps(acc[i], _mm512_permute_ps(acc[i], 0xB1));
    const __m256 rows = _mm512_castps512_ps256(_mm512_permutexvar_ps(row_order, pairs));
    _mm256_storeu_ps(res[i], _mm256_add_ps(rows, min_term[i]));
  }
}

// the kernel types dot8_kquant512 takes
template <typename Kernel>
constexpr bool kWideK512 = false;
template <int64_t Type>
constexpr bool kWideK512<KQuant45<Type>> = true;
template <>
constexpr bool kWideK512<Q6_KKernel> = true;

// the kernel types dot8_legacy512 takes
template <typename Kernel>
constexpr bool kWide512 = false;
template <int64_t Type>
constexpr bool kWide512<LegacyUnsigned<Type>> = true;

}  // namespace qwenserve::cpu::ggml::x86

#endif  // QS_X86_AVX512BW

// The ggml kernels on AVX-512 (F and BW, on top of AVX2): the q8_0 activation quantizer 16 lanes wide, and the
// decode kernel of the 32-blocks with 4-bit codes (dot8_legacy512), which keeps two weight rows in one 512-bit
// vector.
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

// the kernel types dot8_legacy512 takes
template <typename Kernel>
constexpr bool kWide512 = false;
template <int64_t Type>
constexpr bool kWide512<LegacyUnsigned<Type>> = true;

}  // namespace qwenserve::cpu::ggml::x86

#endif  // QS_X86_AVX512BW

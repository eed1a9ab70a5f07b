// The ggml kernels on AVX2 (with FMA and F16C): each kernel type's block decoder and integer dot product in
// 256-bit registers, one weight row against up to 4 activation rows (dot_rows) and, in the decode layout, a group
// of 8 weight rows at a time (dot8). Weight codes stay unsigned (0..15, 0..31, 0..63) and their offsets come in
// through the activation block sums (see ggml/common.h), so 32 weights take one u8 x s8 dot product
// (_mm256_maddubs_epi16); only Q8_0 weights are signed (sign trick).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_features.h"
#include "ggml/common.h"

#if QS_X86_AVX2

namespace qwenserve::cpu::ggml::x86 {

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i in_lane0(int32_t v) { return _mm256_setr_epi32(v, 0, 0, 0, 0, 0, 0, 0); }

// 8 int32 lanes, lane i = sum of the 4 products u[4i..4i+3] * s[4i..4i+3] (u unsigned, s signed). With
// maddubs + madd the pair sums pass through int16: exact while every |u0 s0 + u1 s1| <= 32767, which holds for
// every caller (codes <= 31 against |s| <= 127, or |u| <= 128 against |s| <= 127 for Q8_0's sign trick).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if QS_X86_AVX512_VNNI_VL
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif QS_X86_AVX_VNNI
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 16 packed bytes -> 32 codes: the low nibbles (weights 0..15), then the high nibbles (weights 16..31). One
// broadcast load puts the bytes in both halves and the upper half is shifted per dword: an insert of a shifted copy
// took one ALU op more, on the shuffle port (docs/performance.md, the AVX2 section)
inline __m256i nibbles32(const uint8_t* p) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

// byte i = 0x10 where bit i of h is set, else 0
inline __m256i fifth_bits32(uint32_t h) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i <- byte i / 8 of h
      _mm256_set1_epi32(static_cast<int32_t>(h)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// the fp16 at p + r * ld for r = 0..7, as 8 floats
inline __m256 fp16x8(const uint8_t* p, int64_t ld) {
  uint16_t h[8];
  for (int r = 0; r < 8; ++r) std::memcpy(&h[r], p + r * ld, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// quants_ref.cpp's quantize_row_q8_K 8 lanes at a time, with the same float operations (so the same codes and
// scales): the first signed value of largest magnitude sets iscale = -127 / max; codes round(iscale x) to nearest
// even (the default rounding of cvtps), at most 127.
template <typename T>
void quantize_row_q8_K(const T* x, int64_t nb, ActQ8_K* y) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    float v[256];
    load_float(v, x + 256 * b, 256);
    __m256 amax8 = _mm256_setzero_ps();
    for (int k = 0; k < 32; ++k) amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * k)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    ActQ8_K& a = y[b];
    if (amax == 0.0f) {
      std::memset(&a, 0, sizeof(a));
      continue;
    }
    int first = 0;
    while (std::fabs(v[first]) != amax) ++first;
    const float iscale = -127.0f / v[first];
    const __m256 scale = _mm256_set1_ps(iscale);
    const __m256i top = _mm256_set1_epi32(127);
    for (int k = 0; k < 16; ++k) {  // codes 16k .. 16k + 15
      const __m256i q0 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16 * k), scale)), top);
      const __m256i q1 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16 * k + 8), scale)), top);
      const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);  // in order
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.qs + 16 * k),
                       _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
      const __m256i sum8 = _mm256_add_epi32(q0, q1);
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
      a.bsums[k] = static_cast<int16_t>(_mm_cvtsi128_si32(s));
    }
    for (int j = 0; j < 8; ++j) a.bsums32[j] = static_cast<int16_t>(a.bsums[2 * j] + a.bsums[2 * j + 1]);
    a.d = 1.0f / iscale;
  }
}

// A kernel type's AVX2 half, one specialization per kernel type (common.h):
//   decode(blk) -> Codes             the block's weight codes in registers (and what else the sums need),
//   partials(codes, a) -> __m256i    8 int32 lanes whose sum is the block's integer dot product with a,
//   int_offset(a)                    subtracted from that sum (Kernel::kHasOffset),
//   min_sum(codes, a) -> int32       (Kernel::kHasMinTerm) the integer that, times a.d and the fp16 at
//                                    kMinScaleAt, is added to the row (kMinSign +1) or subtracted (-1).
template <typename Kernel>
struct Avx2Kernel;

// Q4_0, Q4_1 and Q5_0
template <int64_t Type>
struct Avx2Kernel<LegacyUnsigned<Type>> {
  using Kernel = LegacyUnsigned<Type>;
  using Act = ActQ8_0;
  struct Codes {
    __m256i q;
  };
  static Codes decode(const uint8_t* blk) {
    __m256i q = nibbles32(blk + Kernel::kQs);
    if constexpr (Type == kQ5_0) {
      uint32_t h;
      std::memcpy(&h, blk + 2, 4);  // x86: little-endian
      q = _mm256_or_si256(q, fifth_bits32(h));
    }
    return {q};
  }
  static __m256i partials(const Codes& c, const Act& a) { return dot_u8s8(c.q, load32(a.qs)); }
  static int32_t int_offset(const Act& a) { return Kernel::kOff * a.sum; }
  static int32_t min_sum(const Codes&, const Act& a) { return a.sum; }
};

// Q8_0: |q| goes in as the unsigned operand and q's signs move onto the activations
template <>
struct Avx2Kernel<Q8_0Kernel> {
  using Act = ActQ8_0;
  struct Codes {
    __m256i q, abs_q;
  };
  static Codes decode(const uint8_t* blk) {
    const __m256i q = load32(blk + 2);
    return {q, _mm256_sign_epi8(q, q)};  // -128 -> 128 as unsigned
  }
  static __m256i partials(const Codes& c, const Act& a) {
    return dot_u8s8(c.abs_q, _mm256_sign_epi8(load32(a.qs), c.q));
  }
  static int32_t int_offset(const Act&) { return 0; }
  static int32_t min_sum(const Codes&, const Act&) { return 0; }
};

// Q4_K and Q5_K
template <int64_t Type>
struct Avx2Kernel<KQuant45<Type>> {
  using Kernel = KQuant45<Type>;
  using Act = ActQ8_K;
  struct Codes {
    __m256i lo[4], hi[4];  // sub-blocks 2c and 2c + 1
    alignas(16) uint8_t scales[16];  // the 8 scales, then the 8 mins
  };
  // scales_mins_k's unpacking, four bytes at a time: bytes 0-3 hold scales 0-3 and (top 2 bits) the high bits of
  // scales 4-7; bytes 4-7 mins 0-3 and the high bits of mins 4-7; bytes 8-11 the low nibbles of scales 4-7 and
  // (high nibbles) of mins 4-7
  static void unpack_scales(const uint8_t* packed, uint8_t* out) {
    uint32_t w[3], u[4];
    std::memcpy(w, packed, 12);
    constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
    u[0] = w[0] & kLow6;
    u[1] = (w[2] & kLow4) | (((w[0] >> 6) & kLow2) << 4);
    u[2] = w[1] & kLow6;
    u[3] = ((w[2] >> 4) & kLow4) | (((w[1] >> 6) & kLow2) << 4);
    // one 16-byte store, so that partials' vector load of the 16 bytes is forwarded from it
    _mm_store_si128(reinterpret_cast<__m128i*>(out), _mm_setr_epi32(static_cast<int>(u[0]), static_cast<int>(u[1]),
                                                                     static_cast<int>(u[2]), static_cast<int>(u[3])));
  }
  static Codes decode(const uint8_t* blk) {
    Codes c;
    unpack_scales(blk + 4, c.scales);
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    // Q5_K: the 5th bits of sub-blocks 2c and 2c+1 are bits 0 and 1 of hb after it is shifted right by 2c
    __m256i hb;
    if constexpr (Type == kQ5_K) hb = load32(blk + 16);
    for (int k = 0; k < 4; ++k) {
      const __m256i bits = load32(blk + Kernel::kQs + 32 * k);
      c.lo[k] = _mm256_and_si256(bits, m0f);
      c.hi[k] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m0f);
      if constexpr (Type == kQ5_K) {
        const __m256i m10 = _mm256_set1_epi8(0x10);
        c.lo[k] = _mm256_or_si256(c.lo[k], _mm256_and_si256(_mm256_slli_epi16(hb, 4), m10));  // bit 0 -> bit 4
        c.hi[k] = _mm256_or_si256(c.hi[k], _mm256_and_si256(_mm256_slli_epi16(hb, 3), m10));  // bit 1 -> bit 4
        hb = _mm256_srli_epi16(hb, 2);  // the next byte's bits come in at the top, never reach bits 0, 1 by k = 3
      }
    }
    return c;
  }
  // sub-block s's scale as an int16 word in every lane: one byte shuffle of the scales in both 128-bit lanes, where
  // a broadcast from the byte took three instructions
  static __m256i scale_words(__m256i scales, int s) {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>(0x8000 | s)));
  }
  static __m256i partials(const Codes& c, const Act& a) {
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(c.scales)));
    __m256i isum = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(c.lo[k], load32(a.qs + 64 * k)),
                                            scale_words(scales, 2 * k));
      const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(c.hi[k], load32(a.qs + 64 * k + 32)),
                                            scale_words(scales, 2 * k + 1));
      isum = _mm256_add_epi32(isum, _mm256_add_epi32(plo, phi));
    }
    return isum;
  }
  static int32_t int_offset(const Act&) { return 0; }
  static int32_t min_sum(const Codes& c, const Act& a) {  // sum_s m[s] bsums32[s]
    const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c.scales + 8)));
    __m128i p = _mm_madd_epi16(mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bsums32)));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(p, _mm_shuffle_epi32(p, _MM_SHUFFLE(2, 3, 0, 1))));
  }
};

template <>
struct Avx2Kernel<Q6_KKernel> {
  using Act = ActQ8_K;
  struct Codes {
    __m256i q[8];       // weights 32 i .. 32 i + 31
    __m256i sc16;       // the 16 scales as int16
    __m256i sc_dup[2];  // scales 0-7, then 8-15, as int16 in both 128-bit lanes
  };
  static Codes decode(const uint8_t* blk) {
    Codes c;
    c.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    c.sc_dup[0] = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(c.sc16));
    c.sc_dup[1] = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(c.sc16, 1));
    const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i qh = load32(blk + 128 + 32 * h);
      const __m256i ql0 = load32(blk + 64 * h), ql1 = load32(blk + 64 * h + 32);
      __m256i* q = c.q + 4 * h;
      q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m0f), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
      q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m0f), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m0f), _mm256_and_si256(qh, m30));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m0f),
                             _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
    }
    return c;
  }
  static __m256i partials(const Codes& c, const Act& a) {
    // the -32 offset: -32 sum_j sc[j] bsum_j
    __m256i isum = _mm256_sub_epi32(_mm256_setzero_si256(),
                                    _mm256_slli_epi32(_mm256_madd_epi16(c.sc16, load32(a.bsums)), 5));
    for (int i = 0; i < 8; ++i) {  // sub-blocks 2i, 2i + 1
      // their scales across the low and the high lane: one byte shuffle of the copy holding them (scale 2i is
      // int16 number 2i % 8 there, at byte j), where building the pair from two scalars took 7 instructions
      const int16_t j = static_cast<int16_t>(4 * (i % 4));
      const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(((j + 3) << 8) | (j + 2))),
                                            _mm_set1_epi16(static_cast<int16_t>(((j + 1) << 8) | j)));
      const __m256i s = _mm256_shuffle_epi8(c.sc_dup[i / 4], pick);
      const __m256i p = _mm256_maddubs_epi16(c.q[i], load32(a.qs + 32 * i));
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, s));
    }
    return isum;
  }
  static int32_t int_offset(const Act&) { return 0; }
  static int32_t min_sum(const Codes&, const Act&) { return 0; }
};

// ---------------------------------------------------------------------------------------------------------------
// Dot products: one weight row with R (1..4) activation rows, and 8 weight rows of the decode layout with R.

template <typename Kernel, int R>
void dot_rows(const uint8_t* w, int64_t bstride, int64_t nb, const typename Kernel::Act* const* y, float* res) {
  using Block = Avx2Kernel<Kernel>;
  __m256 acc[R];
  float extra[R] = {};
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bstride;
    const typename Block::Codes c = Block::decode(blk);  // once for all R activation rows
    const float d = fp16_at(blk + Kernel::kScaleAt);
    const float m = Kernel::kHasMinTerm ? Kernel::kMinSign * fp16_at(blk + Kernel::kMinScaleAt) : 0.0f;
    for (int r = 0; r < R; ++r) {
      const typename Kernel::Act& a = y[r][b];
      __m256i s = Block::partials(c, a);
      if constexpr (Kernel::kHasOffset) s = _mm256_sub_epi32(s, in_lane0(Block::int_offset(a)));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(s), acc[r]);
      if constexpr (Kernel::kHasMinTerm) extra[r] += (m * a.d) * static_cast<float>(Block::min_sum(c, a));
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]) + extra[r];
}

// One group of 8 weight rows in the decode layout (block b of row r at w + (8 b + r) kBytes, see Layout) against
// R activation rows: res[i][r] = row r . activation row i. Per block, the 8 rows' sums come out of one lane
// reduction (hadd tree) per activation row, so the offset, the scales and the accumulation run once per 8 rows,
// and the weights are read as one stream.
template <typename Kernel, int R>
void dot8(const uint8_t* w, int64_t nb, const typename Kernel::Act* const* y, float (*res)[8]) {
  using Block = Avx2Kernel<Kernel>;
  // Read ahead in software: measured at M = 1 from memory, a Q5_0 [9728, 896] took 0.68 ms with the hardware
  // prefetcher alone, 0.47 with 1 KiB ahead, 0.43-0.47 with 4 KiB, 0.47 with 8 KiB, 0.60 with 16 KiB (Q8_0
  // [151936, 896]: 11.3, 9.2, 8.0-11.3, 10.9, 10.5 ms)
  constexpr int64_t kAhead = 4096, kGroupBytes = 8 * Kernel::kBytes;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kGroupBytes;
    alignas(32) int32_t min_sums[R][8];  // the 8 rows' min_sum, applied together below
    for (int64_t line = 0; line < kGroupBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + line), _MM_HINT_T0);
    // rows 0-3 and 4-7 each summed into one vector (lane k: row k % 4's half k / 4) as they are decoded, so only
    // a few vectors per activation row are live at a time
    __m256i quad[2][R];
    for (int half = 0; half < 2; ++half) {
      __m256i pair[2][R];
      for (int p = 0; p < 2; ++p) {
        __m256i s[2][R];
        for (int j = 0; j < 2; ++j) {
          const int r = 4 * half + 2 * p + j;
          const typename Block::Codes c = Block::decode(blk + r * Kernel::kBytes);
          for (int i = 0; i < R; ++i) {
            s[j][i] = Block::partials(c, y[i][b]);
            if constexpr (Kernel::kHasMinTerm) min_sums[i][r] = Block::min_sum(c, y[i][b]);
          }
        }
        for (int i = 0; i < R; ++i) pair[p][i] = _mm256_hadd_epi32(s[0][i], s[1][i]);
      }
      for (int i = 0; i < R; ++i) quad[half][i] = _mm256_hadd_epi32(pair[0][i], pair[1][i]);
    }
    const __m256 d = fp16x8(blk + Kernel::kScaleAt, Kernel::kBytes);
    for (int i = 0; i < R; ++i) {
      const typename Kernel::Act& a = y[i][b];
      __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(quad[0][i], quad[1][i], 0x20),
                                      _mm256_permute2x128_si256(quad[0][i], quad[1][i], 0x31));  // lane r: row r
      if constexpr (Kernel::kHasOffset) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(Block::int_offset(a)));
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.d)), _mm256_cvtepi32_ps(sums), acc[i]);
    }
    if constexpr (Kernel::kHasMinTerm) {
      const __m256 m = _mm256_mul_ps(fp16x8(blk + Kernel::kMinScaleAt, Kernel::kBytes),
                                     _mm256_set1_ps(Kernel::kMinSign));
      for (int i = 0; i < R; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(m, _mm256_set1_ps(y[i][b].d)),
                                 _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(min_sums[i]))),
                                 acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(res[i], acc[i]);
}

}  // namespace qwenserve::cpu::ggml::x86

#endif  // QS_X86_AVX2

// Linear layers straight on ggml-quantized weights (ggml_mm) and ggml block decoding (ggml_dequantize), for
// Q4_0, Q4_1, Q5_0, Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K (super-blocks of 256).
//
// ggml_mm works as llama.cpp does on the CPU: every activation row is quantized once per call, to blocks of 32
// int8 with one scale (q8_0, for the 32-blocks) or of 256 with one fp32 scale and sums of 16 (q8_K, for the
// K-quants), exactly as ggml's reference quantizers; each (weight block, activation block) pair then gives an
// exact integer dot product, which is scaled and accumulated in float (act_levels 2, for float32 runs: what each
// row's codes leave is quantized as one more row, and the two rows' results summed). Weight codes stay unsigned
// (0..15, 0..31, 0..63) and their offsets (-8, -16, -32 in integers; Q4_1's m and the K-quants' -dmin * min in
// float) are folded in through the activation block sums, so the AVX2 path needs one _mm256_maddubs_epi16
// (u8 x s8) per 32 weights; only Q8_0 weights are signed (sign trick).
// The portable scalar path computes the same integer sum per block; the two differ only in float summation order.
// Work is split over weight rows (each weight byte is read once per call: decode is memory-bound), and every
// decoded weight block serves up to 4 activation rows. At one activation row (decode) weights held in the decode
// layout (rows in groups of 8, a block of each side by side: see Layout) go 8 rows at a time, read ahead in
// software: measured on 2 AVX2 cores with the bundled model's weights from memory, 1.0x (Q6_K) to 1.5x (Q5_0) the
// speed of row by row in the file's layout. With AVX512-VNNI, from 4 activation rows (K-quants: 8) a group of 8
// weight rows is decoded once per call and swept by all activation rows, 16 at a time (mm_tiles); from 16
// activation rows, groups of 16 weight rows, one per int32 lane (mm_tiles16).
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
// ggml_dequantize reproduces qwenserve/model/loader/dequant.py bit for bit: every product there is exact in
// float32 (an fp16 mantissa times integers of at most 13 bits), so only the final addition of Q4_1's m and the
// K-quants' final subtraction round, once (the same whether or not the compiler fuses them into an fma).

#include <ATen/Parallel.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

// The AVX2 path needs FMA and F16C too; every AVX2 CPU has them and -march=native turns them on together.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QS_GGML_AVX2 1
#else
#define QS_GGML_AVX2 0
#endif
// AVX-512 (BW for the byte ops) widens the decode kernel of the 32-blocks with 4-bit codes (dot8_legacy512)
#if QS_GGML_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define QS_GGML_AVX512 1
#else
#define QS_GGML_AVX512 0
#endif
// AVX512-VNNI adds the tile kernel for many activation rows (mm_tiles)
#if QS_GGML_AVX512 && defined(__AVX512VNNI__)
#define QS_GGML_TILES 1
#else
#define QS_GGML_TILES 0
#endif

namespace qwenserve::cpu {
namespace {

constexpr int64_t kDecodeGroup = 8;  // rows per group in the decode layout (see Layout)

enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct BlockInfo {
  int64_t elems, bytes;
};

BlockInfo block_info(int64_t type) {
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
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Weight codes, one block at a time (the portable decoders, shared by ggml_dequantize and the scalar dot products)

// Q4_0, Q4_1 (and Q5_0's low 4 bits): 16 packed bytes -> 32 codes, the low nibbles then the high nibbles
void codes_nibbles(const uint8_t* qs, int32_t* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 0x0F;
    q[j + 16] = qs[j] >> 4;
  }
}

void codes_q5_0(const uint8_t* b, int32_t* q) {
  const uint32_t h = b[2] | (b[3] << 8) | (b[4] << 16) | (static_cast<uint32_t>(b[5]) << 24);
  codes_nibbles(b + 6, q);
  for (int j = 0; j < 32; ++j) q[j] |= ((h >> j) & 1) << 4;
}

void codes_q8_0(const uint8_t* b, int32_t* q) {
  for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(b[2 + j]);
}

// Q4_K/Q5_K: 8 six-bit scales and mins in 12 bytes (ggml's get_scale_min_k4)
void scales_mins_k(const uint8_t* s, int32_t* sc, int32_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Q4_K (qh == nullptr) and Q5_K codes of a super-block: 4 chunks of 32 bytes, low nibbles then high nibbles
void codes_k4_k5(const uint8_t* qs, const uint8_t* qh, int32_t* q) {
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      q[64 * c + l] = qs[32 * c + l] & 0x0F;
      q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  if (qh != nullptr)
    for (int s = 0; s < 8; ++s)
      for (int l = 0; l < 32; ++l) q[32 * s + l] |= ((qh[l] >> s) & 1) << 4;
}

void codes_q6_k(const uint8_t* b, int32_t* q) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const int n = 128 * h, hb = qh[32 * h + l];
      q[n + l] = (ql[64 * h + l] & 0x0F) | ((hb & 3) << 4);
      q[n + l + 32] = (ql[64 * h + 32 + l] & 0x0F) | (((hb >> 2) & 3) << 4);
      q[n + l + 64] = (ql[64 * h + l] >> 4) | (((hb >> 4) & 3) << 4);
      q[n + l + 96] = (ql[64 * h + 32 + l] >> 4) | (((hb >> 6) & 3) << 4);
    }
}

// One block -> float32, with dequant.py's operations (products exact, see the top of the file)
void dequantize_block(int64_t type, const uint8_t* b, float* out) {
  int32_t q[256];
  switch (type) {
    case kQ4_0:
    case kQ5_0:
    case kQ8_0: {
      const float d = fp16_at(b);
      const int off = type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : 0;
      if (type == kQ4_0) codes_nibbles(b + 2, q);
      else if (type == kQ5_0) codes_q5_0(b, q);
      else codes_q8_0(b, q);
      for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(q[j] - off) * d;
      break;
    }
    case kQ4_1: {
      const float d = fp16_at(b), m = fp16_at(b + 2);
      codes_nibbles(b + 4, q);
      for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(q[j]) * d + m;
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = fp16_at(b), dmin = fp16_at(b + 2);
      int32_t sc[8], mn[8];
      scales_mins_k(b + 4, sc, mn);
      if (type == kQ4_K) codes_k4_k5(b + 16, nullptr, q);
      else codes_k4_k5(b + 48, b + 16, q);
      for (int s = 0; s < 8; ++s) {
        const float ds = d * static_cast<float>(sc[s]), dm = dmin * static_cast<float>(mn[s]);
        for (int l = 0; l < 32; ++l) out[32 * s + l] = ds * static_cast<float>(q[32 * s + l]) - dm;
      }
      break;
    }
    case kQ6_K: {
      const float d = fp16_at(b + 208);
      codes_q6_k(b, q);
      for (int j = 0; j < 16; ++j) {
        const float ds = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
        for (int l = 0; l < 16; ++l) out[16 * j + l] = ds * static_cast<float>(q[16 * j + l] - 32);
      }
      break;
    }
    default: break;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Activation quantizers (ggml's quantize_row_q8_0_ref and quantize_row_q8_K_ref), one row at a time

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

#if QS_GGML_AVX512
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
#endif

template <typename T>
void quantize_row_q8_0(const T* x, int64_t nb, ActQ8_0* y) {
#if QS_GGML_AVX512
  if constexpr (kWideLoad<T>) {
    for (int64_t b = 0; b < nb; ++b) quantize_block_q8_0_512(x + 32 * b, y[b]);
    return;
  }
#endif
  for (int64_t b = 0; b < nb; ++b) {
    float v[32], amax = 0.0f;
    load_float(v, x + 32 * b, 32);
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::round(v[j] * id));  // half away from zero, as roundf
      y[b].qs[j] = static_cast<int8_t>(q);
      sum += q;
    }
    y[b].d = static_cast<float>(c10::Half(d));  // ggml stores d as fp16 (the quants used the float32 d)
    y[b].sum = sum;
    y[b].quad_sums[0] = 0;
    for (int j = 0; j < 32; j += 8)
      for (int l = 0; l < 4; ++l) y[b].quad_sums[0] += y[b].qs[j + l];
    y[b].quad_sums[1] = sum - y[b].quad_sums[0];
  }
}

// ggml's nearest_int (round to nearest, ties to even) of the float32 product iscale * x. Not its "+ 1.5 * 2^23"
// trick: the compiler may fuse that add with the product (an fma), which rounds once where ggml rounds twice.
inline int nearest_int(float f) { return static_cast<int>(std::nearbyint(f)); }

template <typename T>
void quantize_row_q8_K(const T* x, int64_t nb, ActQ8_K* y) {
  for (int64_t b = 0; b < nb; ++b) {
    float v[256], amax = 0.0f, max = 0.0f;
    load_float(v, x + 256 * b, 256);
    for (int j = 0; j < 256; ++j) {  // the signed value of largest magnitude (the first one)
      const float ax = std::fabs(v[j]);
      if (ax > amax) {
        amax = ax;
        max = v[j];
      }
    }
    ActQ8_K& a = y[b];
    if (amax == 0.0f) {
      std::memset(&a, 0, sizeof(a));
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; ++j) a.qs[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * v[j])));
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += a.qs[16 * j + l];
      a.bsums[j] = static_cast<int16_t>(s);
    }
    for (int j = 0; j < 8; ++j) a.bsums32[j] = static_cast<int16_t>(a.bsums[2 * j] + a.bsums[2 * j + 1]);
    a.d = 1.0f / iscale;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Block kernels (one per weight type) and the dot products built on them: res[r] = sum_k w[k] * y[r][k].

#if QS_GGML_AVX2
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
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 16 packed bytes -> 32 codes: the low nibbles (weights 0..15), then the high nibbles (weights 16..31)
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
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
#endif

// Each kernel type describes its blocks; the drivers below do the rest. On AVX2 a kernel gives
//   decode(blk) -> Codes             the block's weight codes in registers (and what else the sums need),
//   partials(codes, a) -> __m256i    8 int32 lanes whose sum is the block's integer dot product with a,
//   int_offset(a)                    subtracted from that sum (kHasOffset: the codes' fixed offset),
//   min_sum(codes, a) -> int32       (kHasMinTerm: Q4_1's m, the K-quants' mins) an integer that, times a.d and
//                                    the fp16 at kMinScaleAt, is added to the row (kMinSign +1) or subtracted (-1),
// and the row gets, per block, d * a.d * (lane sum - int_offset) + kMinSign * m * a.d * min_sum, d and m being
// the fp16s at kScaleAt and kMinScaleAt.
// The portable path is each kernel's dot<R>, which forms the same integer sum per block.

// Q4_0, Q4_1 and Q5_0: unsigned codes. Q4_0, Q5_0: sum (q - off) y = sum q y - off * sum y, the correction in
// integers; Q4_1: sum (d q + m) y = d sum q y + m sum y, the min's term in float (m dy sum y per block).
template <int64_t Type>
struct LegacyUnsigned {
  static constexpr int kQs = Type == kQ4_0 ? 2 : Type == kQ4_1 ? 4 : 6;  // where the packed nibbles start
  static constexpr int64_t kBlock = 32, kBytes = kQs + 16, kScaleAt = 0;
  static constexpr int32_t kOff = Type == kQ4_0 ? 8 : Type == kQ5_0 ? 16 : 0;
  static constexpr bool kHasOffset = kOff != 0, kHasMinTerm = Type == kQ4_1;
  static constexpr int64_t kMinScaleAt = 2;
  static constexpr float kMinSign = 1.0f;
  using Act = ActQ8_0;

#if QS_GGML_AVX2
  struct Codes {
    __m256i q;
  };
  static Codes decode(const uint8_t* blk) {
    __m256i q = nibbles32(blk + kQs);
    if constexpr (Type == kQ5_0) {
      uint32_t h;
      std::memcpy(&h, blk + 2, 4);  // x86: little-endian
      q = _mm256_or_si256(q, fifth_bits32(h));
    }
    return {q};
  }
  static __m256i partials(const Codes& c, const Act& a) { return dot_u8s8(c.q, load32(a.qs)); }
  static int32_t int_offset(const Act& a) { return kOff * a.sum; }
  static int32_t min_sum(const Codes&, const Act& a) { return a.sum; }
#else
  template <int R>
  static void dot(const uint8_t* w, int64_t bstride, int64_t nb, const Act* const* y, float* res) {
    float acc[R] = {}, accm[R] = {};
    int32_t q[32];
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * bstride;
      const float dw = fp16_at(blk), mw = Type == kQ4_1 ? fp16_at(blk + 2) : 0.0f;
      if constexpr (Type == kQ5_0) codes_q5_0(blk, q);
      else codes_nibbles(blk + kQs, q);
      for (int r = 0; r < R; ++r) {
        const Act& a = y[r][b];
        int32_t s = 0;
        for (int j = 0; j < 32; ++j) s += q[j] * a.qs[j];
        s -= kOff * a.sum;
        acc[r] += (dw * a.d) * static_cast<float>(s);
        if constexpr (Type == kQ4_1) accm[r] += (mw * a.d) * static_cast<float>(a.sum);
      }
    }
    for (int r = 0; r < R; ++r) res[r] = acc[r] + accm[r];
  }
#endif
};

// Q8_0: signed codes; on AVX2 |q| goes in as the unsigned operand and q's signs move onto y.
struct Q8_0Kernel {
  static constexpr int64_t kBlock = 32, kBytes = 34, kScaleAt = 0, kMinScaleAt = 0;
  static constexpr bool kHasOffset = false, kHasMinTerm = false;
  static constexpr float kMinSign = 0.0f;
  using Act = ActQ8_0;

#if QS_GGML_AVX2
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
#else
  template <int R>
  static void dot(const uint8_t* w, int64_t bstride, int64_t nb, const Act* const* y, float* res) {
    float acc[R] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * bstride;
      const float dw = fp16_at(blk);
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int r = 0; r < R; ++r) {
        const Act& a = y[r][b];
        int32_t s = 0;
        for (int j = 0; j < 32; ++j) s += q[j] * a.qs[j];
        acc[r] += (dw * a.d) * static_cast<float>(s);
      }
    }
    for (int r = 0; r < R; ++r) res[r] = acc[r];
  }
#endif
};

// Q4_K and Q5_K: per super-block, isum = sum_s sc[s] sum_{i in s} q_i y_i and msum = sum_s m[s] sum_{i in s} y_i;
// the row gets d dy isum - dmin dy msum.
template <int64_t Type>
struct KQuant45 {
  static constexpr int64_t kBlock = 256, kBytes = Type == kQ4_K ? 144 : 176, kScaleAt = 0;
  static constexpr int kQs = Type == kQ4_K ? 16 : 48;
  static constexpr bool kHasOffset = false, kHasMinTerm = true;
  static constexpr int64_t kMinScaleAt = 2;
  static constexpr float kMinSign = -1.0f;
  using Act = ActQ8_K;

#if QS_GGML_AVX2
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
    std::memcpy(out, u, 16);
  }
  static Codes decode(const uint8_t* blk) {
    Codes c;
    unpack_scales(blk + 4, c.scales);
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    // Q5_K: the 5th bits of sub-blocks 2c and 2c+1 are bits 0 and 1 of hb after it is shifted right by 2c
    __m256i hb;
    if constexpr (Type == kQ5_K) hb = load32(blk + 16);
    for (int k = 0; k < 4; ++k) {
      const __m256i bits = load32(blk + kQs + 32 * k);
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
  static __m256i partials(const Codes& c, const Act& a) {
    __m256i isum = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(c.lo[k], load32(a.qs + 64 * k)),
                                            _mm256_set1_epi16(c.scales[2 * k]));
      const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(c.hi[k], load32(a.qs + 64 * k + 32)),
                                            _mm256_set1_epi16(c.scales[2 * k + 1]));
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
#else
  template <int R>
  static void dot(const uint8_t* w, int64_t bstride, int64_t nb, const Act* const* y, float* res) {
    float acc[R] = {}, accm[R] = {};
    int32_t q[256], sc[8], mn[8];
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * bstride;
      const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
      scales_mins_k(blk + 4, sc, mn);
      codes_k4_k5(blk + kQs, Type == kQ5_K ? blk + 16 : nullptr, q);
      for (int r = 0; r < R; ++r) {
        const Act& a = y[r][b];
        int32_t isum = 0, msum = 0;
        for (int s = 0; s < 8; ++s) {
          int32_t p = 0;
          for (int l = 0; l < 32; ++l) p += q[32 * s + l] * a.qs[32 * s + l];
          isum += sc[s] * p;
          msum += mn[s] * a.bsums32[s];
        }
        acc[r] += (d * a.d) * static_cast<float>(isum);
        accm[r] += (dmin * a.d) * static_cast<float>(msum);
      }
    }
    for (int r = 0; r < R; ++r) res[r] = acc[r] - accm[r];
  }
#endif
};

// Q6_K: isum = sum_j sc[j] (sum_{i in j} q_i y_i - 32 bsum_j) over the 16 sub-blocks of 16; the row gets d dy isum.
struct Q6_KKernel {
  static constexpr int64_t kBlock = 256, kBytes = 210, kScaleAt = 208, kMinScaleAt = 0;
  static constexpr bool kHasOffset = false, kHasMinTerm = false;
  static constexpr float kMinSign = 0.0f;
  using Act = ActQ8_K;

#if QS_GGML_AVX2
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
#else
  template <int R>
  static void dot(const uint8_t* w, int64_t bstride, int64_t nb, const Act* const* y, float* res) {
    float acc[R] = {};
    int32_t q[256];
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * bstride;
      const float d = fp16_at(blk + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      codes_q6_k(blk, q);
      for (int r = 0; r < R; ++r) {
        const Act& a = y[r][b];
        int32_t isum = 0;
        for (int j = 0; j < 16; ++j) {
          int32_t p = 0;
          for (int l = 0; l < 16; ++l) p += q[16 * j + l] * a.qs[16 * j + l];
          isum += sc[j] * (p - 32 * a.bsums[j]);
        }
        acc[r] += (d * a.d) * static_cast<float>(isum);
      }
    }
    for (int r = 0; r < R; ++r) res[r] = acc[r];
  }
#endif
};

// ---------------------------------------------------------------------------------------------------------------
// Dot products: one weight row with R (1..4) activation rows, and (decode, AVX2) 8 weight rows with one.

template <typename Kernel, int R>
void dot_rows(const uint8_t* w, int64_t bstride, int64_t nb, const typename Kernel::Act* const* y, float* res) {
#if QS_GGML_AVX2
  __m256 acc[R];
  float extra[R] = {};
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bstride;
    const typename Kernel::Codes c = Kernel::decode(blk);  // once for all R activation rows
    const float d = fp16_at(blk + Kernel::kScaleAt);
    const float m = Kernel::kHasMinTerm ? Kernel::kMinSign * fp16_at(blk + Kernel::kMinScaleAt) : 0.0f;
    for (int r = 0; r < R; ++r) {
      const typename Kernel::Act& a = y[r][b];
      __m256i s = Kernel::partials(c, a);
      if constexpr (Kernel::kHasOffset) s = _mm256_sub_epi32(s, in_lane0(Kernel::int_offset(a)));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(s), acc[r]);
      if constexpr (Kernel::kHasMinTerm) extra[r] += (m * a.d) * static_cast<float>(Kernel::min_sum(c, a));
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]) + extra[r];
#else
  Kernel::template dot<R>(w, bstride, nb, y, res);
#endif
}

#if QS_GGML_AVX2
// One group of 8 weight rows in the decode layout (block b of row r at w + (8 b + r) kBytes, see Layout) against
// R activation rows: res[i][r] = row r . activation row i. Per block, the 8 rows' sums come out of one lane
// reduction (hadd tree) per activation row, so the offset, the scales and the accumulation run once per 8 rows,
// and the weights are read as one stream.
template <typename Kernel, int R>
void dot8(const uint8_t* w, int64_t nb, const typename Kernel::Act* const* y, float (*res)[8]) {
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
          const typename Kernel::Codes c = Kernel::decode(blk + r * Kernel::kBytes);
          for (int i = 0; i < R; ++i) {
            s[j][i] = Kernel::partials(c, y[i][b]);
            if constexpr (Kernel::kHasMinTerm) min_sums[i][r] = Kernel::min_sum(c, y[i][b]);
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
      if constexpr (Kernel::kHasOffset) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(Kernel::int_offset(a)));
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
#endif

#if QS_GGML_AVX512
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
#if defined(__AVX512VNNI__)
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

#if QS_GGML_TILES
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
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  t.scale = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(fp16x8(blk + Kernel::kScaleAt, Kernel::kBytes)));
  if constexpr (Kernel::kHasMinTerm)
    t.min = _mm512_maskz_permutexvar_ps(0x5555, twice,
                                        _mm512_castps256_ps512(fp16x8(blk + Kernel::kMinScaleAt, Kernel::kBytes)));
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

// One row's super-block as both K-quant tile layouts take it: 8 chunks of 32 codes (sub-blocks of 32, or two of
// Q6_K's 16 each), the sub-block scales, the int16 pairs vpdpwssd takes (pair p: the mins, or Q6_K's scales, 2p and
// 2p + 1; Q4_K / Q5_K's pairs 4..7 zero), d and dmin
struct SuperBlockRow {
  __m256i chunk[8];
  int32_t scales[16];  // Q4_K, Q5_K: the first 8
  int32_t pairs[8];
  float d, dmin;
};

template <typename Kernel>
inline SuperBlockRow decode_superblock_row(const uint8_t* rb) {
  SuperBlockRow row;
  const typename Kernel::Codes c = Kernel::decode(rb);
  int32_t pair_values[16] = {};  // Q6_K's 16 scales, or the 8 mins
  if constexpr (std::is_same_v<Kernel, Q6_KKernel>) {
    for (int i = 0; i < 8; ++i) row.chunk[i] = c.q[i];
    for (int j = 0; j < 16; ++j) pair_values[j] = row.scales[j] = static_cast<int8_t>(rb[192 + j]);
    row.d = fp16_at(rb + 208);
    row.dmin = 0.0f;
  } else {
    for (int k = 0; k < 4; ++k) {
      row.chunk[2 * k] = c.lo[k];
      row.chunk[2 * k + 1] = c.hi[k];
    }
    for (int j = 0; j < 8; ++j) {
      row.scales[j] = c.scales[j];
      pair_values[j] = c.scales[8 + j];
    }
    row.d = fp16_at(rb);
    row.dmin = fp16_at(rb + 2);
  }
  for (int p = 0; p < 8; ++p)
    row.pairs[p] = static_cast<int32_t>((static_cast<uint32_t>(pair_values[2 * p]) & 0xFFFFu) |
                                        (static_cast<uint32_t>(pair_values[2 * p + 1]) << 16));
  return row;
}

template <typename Kernel>
inline void decode_tile_block(const uint8_t* blk, TileSuperBlock& t) {
  constexpr int kScales = std::is_same_v<Kernel, Q6_KKernel> ? 16 : 8;
  __m256i chunk[8][8];  // row, 32-code chunk
  alignas(32) float d[8], dmin[8];
  for (int r = 0; r < 8; ++r) {
    const SuperBlockRow row = decode_superblock_row<Kernel>(blk + r * Kernel::kBytes);
    for (int c = 0; c < 8; ++c) chunk[r][c] = row.chunk[c];
    for (int j = 0; j < kScales; ++j) t.scales[j][2 * r] = t.scales[j][2 * r + 1] = row.scales[j];
    for (int p = 0; p < 8; ++p) t.pairs[p / 2][2 * r + p % 2] = row.pairs[p];  // lane 2r + t of u: pair 2u + t
    d[r] = row.d;
    dmin[r] = row.dmin;
  }
  for (int c = 0; c < 8; ++c) {
    const __m512i pair[4] = {pair_of(chunk[0][c], chunk[1][c]), pair_of(chunk[2][c], chunk[3][c]),
                             pair_of(chunk[4][c], chunk[5][c]), pair_of(chunk[6][c], chunk[7][c])};
    interleave_rows(pair, t.codes + 4 * c);
  }
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  t.d = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(_mm256_load_ps(d)));
  t.dmin = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(_mm256_load_ps(dmin)));
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
template <typename Kernel, int R, typename Tile>
void tile_rows(const Tile* tile, int64_t nb, const typename Kernel::Act* act, const int64_t* start,
               float (*res)[8]) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Tile& t = tile[b];
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

// rows: 16 weight rows' block b, rows 0-7 from one group of the decode layout and 8-15 from the next
template <typename Kernel>
inline void decode_tile_block16(const uint8_t* g0, const uint8_t* g1, TileBlock16& t) {
  __m256i rows[16];
  for (int r = 0; r < 16; ++r) {
    const uint8_t* blk = (r < 8 ? g0 : g1) + (r % 8) * Kernel::kBytes;
    if constexpr (std::is_same_v<Kernel, Q8_0Kernel>)
      rows[r] = _mm256_xor_si256(load32(blk + 2), _mm256_set1_epi8(-128));  // q + 128, unsigned
    else
      rows[r] = Kernel::decode(blk).q;
  }
  transpose_16x8(rows, t.codes);
  auto both = [](__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
  };
  t.scale = both(fp16x8(g0 + Kernel::kScaleAt, Kernel::kBytes), fp16x8(g1 + Kernel::kScaleAt, Kernel::kBytes));
  if constexpr (Kernel::kHasMinTerm)
    t.min = both(fp16x8(g0 + Kernel::kMinScaleAt, Kernel::kBytes), fp16x8(g1 + Kernel::kMinScaleAt, Kernel::kBytes));
}

template <typename Kernel, int R>
void tile16_rows(const TileBlock16* tile, int64_t nb, const ActQ8_0* act, float (*res)[16]) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const TileBlock16& t = tile[b];
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
  __m256i chunk[8][16];  // 32-code chunk, row
  alignas(64) int32_t scales[16][16], pairs[8][16];
  alignas(64) float d[16], dmin[16];
  for (int r = 0; r < 16; ++r) {
    const SuperBlockRow row = decode_superblock_row<Kernel>((r < 8 ? g0 : g1) + (r % 8) * Kernel::kBytes);
    for (int c = 0; c < 8; ++c) chunk[c][r] = row.chunk[c];
    for (int j = 0; j < (kQ6 ? 16 : 8); ++j) scales[j][r] = row.scales[j];
    for (int p = 0; p < 8; ++p) pairs[p][r] = row.pairs[p];
    d[r] = row.d;
    dmin[r] = row.dmin;
  }
  for (int c = 0; c < 8; ++c) transpose_16x8(chunk[c], t.codes + 8 * c);
  for (int j = 0; j < (kQ6 ? 16 : 8); ++j) t.scales[j] = _mm512_load_si512(scales[j]);
  for (int u = 0; u < (kQ6 ? 8 : 4); ++u) t.pairs[u] = _mm512_load_si512(pairs[u]);
  t.d = _mm512_load_ps(d);
  t.dmin = _mm512_load_ps(dmin);
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
template <typename Kernel, int R>
void tile16_rows(const TileSuperBlock16* tile, int64_t nb, const ActQ8_K* act, float (*res)[16]) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const TileSuperBlock16& t = tile[b];
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
#endif

template <typename Kernel>
constexpr bool kWide512 = false;
template <int64_t Type>
constexpr bool kWide512<LegacyUnsigned<Type>> = true;
#endif

#if QS_GGML_AVX2
// One group of 8 weight rows in the decode layout against R activation rows: the widest kernel this build has.
template <typename Kernel, int R>
void decode_group(const uint8_t* w, int64_t nb, const typename Kernel::Act* const* y, float (*res)[8]) {
#if QS_GGML_AVX512
  if constexpr (kWide512<Kernel>) {
    dot8_legacy512<Kernel, R>(w, nb, y, res);
    return;
  }
#endif
  dot8<Kernel, R>(w, nb, y, res);
}
#endif

#if QS_GGML_AVX2
// ---------------------------------------------------------------------------------------------------------------
// Dequantizing on AVX2: each kernel's decode() gives the codes in registers, then 8 at a time they become floats
// with the same operations as dequantize_block (so the same bits), and are stored in the output dtype. The dense
// route of the quantized layers dequantizes every weight once per call (each prefill step, and each decode step
// from 32 rows where the CPU has native bf16): done a block at a time through dequantize_block's scalar loops it
// cost more than the matmul itself.

// Codes as floats, 8 (AVX2) or 16 (AVX-512) at a time. The value functions below use GCC's vector operators
// (a scalar operand is broadcast), so one body serves both widths.
template <int Part, bool Signed>
inline __m256 code_floats8(__m256i q) {  // bytes 8 Part .. 8 Part + 7
  const __m128i half = Part < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
  const __m128i b = Part % 2 ? _mm_unpackhi_epi64(half, half) : half;
  return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

template <typename T>
inline void store8(T* o, __m256 v) {  // any other dtype (the dispatch includes double)
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) o[i] = from_float<T>(f[i]);
}
inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }
inline void store8(c10::BFloat16* o, __m256 v) {  // from_float's rounding (to nearest even; NaN -> 0x7FC0)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // 8 uint16 in the low half
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(packed));
}
inline void store8(c10::Half* o, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

#if QS_GGML_AVX512
template <int Half, bool Signed>
inline __m512 code_floats16(__m256i q) {  // bytes 16 Half .. 16 Half + 15
  const __m128i b = Half ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
  return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

template <typename T>
inline void store16(T* o, __m512 v) {
  store8(o, _mm512_castps512_ps256(v));
  store8(o + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
inline void store16(c10::BFloat16* o, __m512 v) {  // as store8
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
}
inline void store16(c10::Half* o, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif

// 32 codes -> o[0..31] = value(floats of some of them, h), h = 0 for codes 0..15 and 1 for codes 16..31
template <bool Signed, typename T, typename Value>
inline void store_codes32(T* o, __m256i q, Value value) {
#if QS_GGML_AVX512
  store16(o, value(code_floats16<0, Signed>(q), 0));
  store16(o + 16, value(code_floats16<1, Signed>(q), 1));
#else
  store8(o, value(code_floats8<0, Signed>(q), 0));
  store8(o + 8, value(code_floats8<1, Signed>(q), 0));
  store8(o + 16, value(code_floats8<2, Signed>(q), 1));
  store8(o + 24, value(code_floats8<3, Signed>(q), 1));
#endif
}

template <int64_t Type, typename T>
void dequantize_legacy(const uint8_t* b, T* o) {
  const float d = fp16_at(b);
  if constexpr (Type == kQ8_0) {
    store_codes32<true>(o, load32(b + 2), [&](auto f, int) { return f * d; });
  } else if constexpr (Type == kQ4_1) {
    const float m = fp16_at(b + 2);
    store_codes32<false>(o, LegacyUnsigned<Type>::decode(b).q, [&](auto f, int) { return f * d + m; });
  } else {
    constexpr float off = LegacyUnsigned<Type>::kOff;
    store_codes32<false>(o, LegacyUnsigned<Type>::decode(b).q, [&](auto f, int) { return (f - off) * d; });
  }
}

template <int64_t Type, typename T>
void dequantize_k45(const uint8_t* b, T* o) {
  const typename KQuant45<Type>::Codes c = KQuant45<Type>::decode(b);
  const float d = fp16_at(b), dmin = fp16_at(b + 2);
  for (int s = 0; s < 8; ++s) {  // sub-block s: x = (d sc[s]) q - dmin m[s], the product exact
    const float ds = d * static_cast<float>(c.scales[s]), dm = dmin * static_cast<float>(c.scales[8 + s]);
    store_codes32<false>(o + 32 * s, s % 2 ? c.hi[s / 2] : c.lo[s / 2], [&](auto f, int) { return f * ds - dm; });
  }
}

template <typename T>
void dequantize_q6_k(const uint8_t* b, T* o) {
  const Q6_KKernel::Codes c = Q6_KKernel::decode(b);
  const float d = fp16_at(b + 208);
  for (int i = 0; i < 8; ++i) {  // weights 32 i ..: sub-blocks 2 i and 2 i + 1 of 16, x = (d sc) (q - 32)
    const float ds[2] = {d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * i])),
                         d * static_cast<float>(static_cast<int8_t>(b[193 + 2 * i]))};
    store_codes32<false>(o + 32 * i, c.q[i], [&](auto f, int h) { return (f - 32.0f) * ds[h]; });
  }
}

template <typename T>
void dequantize_block_avx2(int64_t type, const uint8_t* b, T* o) {
  switch (type) {
    case kQ4_0: dequantize_legacy<kQ4_0>(b, o); break;
    case kQ4_1: dequantize_legacy<kQ4_1>(b, o); break;
    case kQ5_0: dequantize_legacy<kQ5_0>(b, o); break;
    case kQ8_0: dequantize_legacy<kQ8_0>(b, o); break;
    case kQ4_K: dequantize_k45<kQ4_K>(b, o); break;
    case kQ5_K: dequantize_k45<kQ5_K>(b, o); break;
    case kQ6_K: dequantize_q6_k(b, o); break;
    default: break;
  }
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// Drivers

template <typename T>
void quantize_row(const T* x, int64_t K, ActQ8_0* y) { quantize_row_q8_0(x, K / 32, y); }
template <typename T>
void quantize_row(const T* x, int64_t K, ActQ8_K* y) { quantize_row_q8_K(x, K / 256, y); }

// x [M, K] -> `levels` quantized rows per row, one after the other. Level 2 quantizes what the first row's codes
// left (x - d q, in float32), so that the pair's two dot products together see about 15 bits of each activation
// instead of 8 (one int8 code's error is up to half a step of max |x| / 127 in its block; the second's, 1/254 of
// that).
template <typename T, typename Act>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t levels, Act* y) {
  constexpr int64_t kElems = std::is_same_v<Act, ActQ8_0> ? 32 : 256;
  const int64_t nb = K / kElems;
  at::parallel_for(0, M, kElems == 32 ? 16 : 4, [&](int64_t m0, int64_t m1) {
    std::vector<float> rest(levels == 2 ? static_cast<size_t>(K) : 0);
    for (int64_t m = m0; m < m1; ++m) {
      Act* codes = y + m * levels * nb;
      quantize_row(x + m * K, K, codes);
      if (levels == 1) continue;
      load_float(rest.data(), x + m * K, K);
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t j = 0; j < kElems; ++j) rest[b * kElems + j] -= codes[b].d * static_cast<float>(codes[b].qs[j]);
      quantize_row(rest.data(), K, codes + nb);
    }
  });
}

// Where a weight row's blocks lie. group 1: a GGUF file's layout, row after row. group 8 (kDecodeGroup): rows in
// groups of 8 with block b of all 8 side by side, so that the decode kernel reads the 8 rows it works on as one
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

#if QS_GGML_TILES
// below this many activation rows the decode kernels stream the weights faster. Since the K-quant sweeps hold a
// sub-block's codes in registers they pay from 4 rows as the 32-blocks' do: Q6_K [896, 4864] at 4 / 5 / 7 rows
// 0.145 / 0.140 / 0.156 ms in tiles, 0.139 / 0.180 / 0.235 in dot8
constexpr int64_t kTileMinRows = 4;
constexpr int kTileRows = 16;        // activation rows per pass over a decoded group (their sums stay in registers)

// f(std::integral_constant<int, r>) for r = 1..kTileRows: the sweeps keep a compile-time count of accumulators
template <typename F, int R = kTileRows>
inline void with_tile_rows(int r, F f) {
  if constexpr (R >= 1) {
    if (r == R) return f(std::integral_constant<int, R>{});
    with_tile_rows<F, R - 1>(r, f);
  }
}

// The next group's bytes into L2 while this group's sweeps compute: with the weights coming from memory (a decode
// step streams the whole model) a thread otherwise waits for each group before it computes, and computes before
// it asks for the next. Weights beyond the L3, 32 activation rows, 2 threads: Q5_0 [9728, 896] 0.66 -> 0.57 ms,
// the Q8_0 LM head [151936, 896] 11.2-11.7 -> 8.9 ms; the 8-row K-quant tiles unchanged (Q6_K [896, 4864] 0.66).
inline void prefetch_group(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T1);
}

// mm_tiles' 16-row form (N a multiple of 16, kTile16MinRows rows or more): TileBlock16 for the 32-blocks,
// TileSuperBlock16 for the K-quants
constexpr int64_t kTile16MinRows = 16;

template <typename Kernel, typename T>
void mm_tiles16(T* out, int64_t ldo, int64_t levels, const typename Kernel::Act* act, int64_t M, int64_t nb,
                const Layout& w, int64_t N, const float* bias) {
  using Tile = std::conditional_t<Kernel::kBlock == 256, TileSuperBlock16, TileBlock16>;
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    std::vector<Tile> tile(static_cast<size_t>(nb));
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* first = w.row(16 * g);
      const uint8_t* second = w.row(16 * g + 8);
      for (int64_t b = 0; b < nb; ++b)
        decode_tile_block16<Kernel>(first + b * 8 * Kernel::kBytes, second + b * 8 * Kernel::kBytes, tile[b]);
      if (g + 1 < g1) prefetch_group(w.row(16 * (g + 1)), 16 * w.ld);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int r = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        float res[kTileRows][16];
        const typename Kernel::Act* a = act + m0 * nb;
        with_tile_rows(r, [&](auto rows) { tile16_rows<Kernel, rows()>(tile.data(), nb, a, res); });
        store_rows<16>(out, ldo, levels, m0, r, 16 * g, res[0], bias);
      }
    }
  });
}

// out[M, N] from weights in the decode layout, a group of 8 rows at a time: decoded once (tile_block's layout,
// a few KiB per group), then swept by the activation rows kTileRows at a time
template <typename Kernel, typename T>
void mm_tiles(T* out, int64_t ldo, int64_t levels, const typename Kernel::Act* act, int64_t M, int64_t nb,
              const Layout& w, int64_t N, const float* bias) {
  using Tile = std::conditional_t<Kernel::kBlock == 256, TileSuperBlock, TileBlock>;
  std::vector<int64_t> start;  // the 32-blocks' starting values (the K-quants need none)
  if constexpr (Kernel::kBlock == 32) {
    start.resize(static_cast<size_t>(M * nb));
    for (int64_t k = 0; k < M * nb; ++k) start[k] = tile_start(act[k], kTileOffset<Kernel>);
  }
  at::parallel_for(0, N / 8, 1, [&](int64_t g0, int64_t g1) {
    std::vector<Tile> tile(static_cast<size_t>(nb));
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* group = w.row(8 * g);
      for (int64_t b = 0; b < nb; ++b) decode_tile_block<Kernel>(group + b * 8 * Kernel::kBytes, tile[b]);
      if (g + 1 < g1) prefetch_group(w.row(8 * (g + 1)), 8 * w.ld);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int r = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        float res[kTileRows][8];
        const typename Kernel::Act* a = act + m0 * nb;
        const int64_t* st = start.empty() ? nullptr : start.data() + m0 * nb;
        with_tile_rows(r, [&](auto rows) { tile_rows<Kernel, rows()>(tile.data(), nb, a, st, res); });
        store_rows<8>(out, ldo, levels, m0, r, 8 * g, res[0], bias);
      }
    }
  });
}
#endif

// out[M / levels, N] from M quantized activation rows (act: M * nb blocks, `levels` rows per output row), by
// whichever kernel suits M and the layout. Every pass below covers an even number of rows from an even one.
template <typename Kernel, typename T>
void mm_quantized(T* out, int64_t ldo, int64_t levels, const std::vector<typename Kernel::Act>& act, int64_t M,
                  int64_t nb, const Layout& w, int64_t N, const float* bias) {
  using Act = typename Kernel::Act;
  const int64_t bstride = w.block_stride();
#if QS_GGML_AVX2
#if QS_GGML_TILES
  if constexpr (kTiles<Kernel>) {
    if (w.group == kDecodeGroup && M >= kTile16MinRows && N % 16 == 0) {
      mm_tiles16<Kernel>(out, ldo, levels, act.data(), M, nb, w, N, bias);
      return;
    }
    if (w.group == kDecodeGroup && M >= kTileMinRows) {
      mm_tiles<Kernel>(out, ldo, levels, act.data(), M, nb, w, N, bias);
      return;
    }
  }
#endif
  if (w.group == kDecodeGroup) {  // a group of 8 weight rows at a time, against up to 4 activation rows
    at::parallel_for(0, N / 8, 2, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const int r = static_cast<int>(std::min<int64_t>(4, M - m0));
          const Act* y[4];
          for (int i = 0; i < r; ++i) y[i] = act.data() + (m0 + i) * nb;
          float res[4][8];
          switch (r) {
            case 4: decode_group<Kernel, 4>(w.row(8 * g), nb, y, res); break;
            case 3: decode_group<Kernel, 3>(w.row(8 * g), nb, y, res); break;
            case 2: decode_group<Kernel, 2>(w.row(8 * g), nb, y, res); break;
            default: decode_group<Kernel, 1>(w.row(8 * g), nb, y, res); break;
          }
          store_rows<8>(out, ldo, levels, m0, r, 8 * g, res[0], bias);
        }
    });
    return;
  }
#endif
  constexpr int64_t kTile = 16;  // weight rows that share one pass over a group of 4 activation rows
  at::parallel_for(0, N, kTile, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
      const int64_t t1 = std::min(n1, t0 + kTile);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int r = static_cast<int>(std::min<int64_t>(4, M - m0));
        const Act* y[4];
        for (int i = 0; i < r; ++i) y[i] = act.data() + (m0 + i) * nb;
        for (int64_t n = t0; n < t1; ++n) {
          const uint8_t* wr = w.row(n);
          float res[4];
          switch (r) {
            case 4: dot_rows<Kernel, 4>(wr, bstride, nb, y, res); break;
            case 3: dot_rows<Kernel, 3>(wr, bstride, nb, y, res); break;
            case 2: dot_rows<Kernel, 2>(wr, bstride, nb, y, res); break;
            default: dot_rows<Kernel, 1>(wr, bstride, nb, y, res); break;
          }
          store_rows<1>(out, ldo, levels, m0, r, n, res, bias);
        }
      }
    }
  });
}

template <typename Kernel, typename T>
void mm_impl(T* out, int64_t ldo, const T* x, int64_t M, int64_t K, const Layout& w, int64_t N, const float* bias,
             int64_t act_levels) {
  const int64_t nb = K / Kernel::kBlock;
  // act_levels 2: each row's remainder runs as one more activation row beside it, through the same kernels (the
  // weights are decoded once for both), and the stores sum the pair
  std::vector<typename Kernel::Act> act(static_cast<size_t>(act_levels * M * nb));
  quantize_rows(x, M, K, act_levels, act.data());
  mm_quantized<Kernel>(out, ldo, act_levels, act, act_levels * M, nb, w, N, bias);
}

template <typename T>
void dequantize_impl(const Layout& w, int64_t type, int64_t rows, int64_t cols, T* out) {
  const BlockInfo bi = block_info(type);
  const int64_t nb = cols / bi.elems;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t r0, int64_t r1) {
    [[maybe_unused]] float buf[256];  // the portable path's block
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        T* o = out + r * cols + b * bi.elems;
        const uint8_t* blk = w.row(r) + b * w.block_stride();
#if QS_GGML_AVX2
        dequantize_block_avx2(type, blk, o);
#else
        if constexpr (std::is_same_v<T, float>) {
          dequantize_block(type, blk, o);
        } else {
          dequantize_block(type, blk, buf);
          for (int64_t j = 0; j < bi.elems; ++j) o[j] = from_float<T>(buf[j]);
        }
#endif
      }
  });
}

// raw's layout, checked against the type, the columns and (when given) the rows
Layout checked_layout(const at::Tensor& raw, int64_t type, int64_t cols, int64_t rows_expected, int64_t group) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2,
              "ggml: raw must be a 2-D uint8 CPU tensor [rows, row_bytes]");
  TORCH_CHECK(raw.stride(1) == 1 || raw.size(1) <= 1, "ggml: raw rows must be contiguous");
  const BlockInfo bi = block_info(type);
  TORCH_CHECK(cols > 0 && cols % bi.elems == 0, "ggml type ", type, ": cols (", cols, ") must be a multiple of ",
              bi.elems);
  TORCH_CHECK(raw.size(1) == cols / bi.elems * bi.bytes, "ggml type ", type, ": ", cols, " columns take ",
              cols / bi.elems * bi.bytes, " bytes a row, raw has ", raw.size(1));
  if (rows_expected >= 0) TORCH_CHECK(raw.size(0) == rows_expected, "ggml_mm: raw has ", raw.size(0),
                                      " rows, out has ", rows_expected, " columns");
  TORCH_CHECK(group == 1 || group == kDecodeGroup, "ggml: rows are grouped by 1 or ", kDecodeGroup, ", not ", group);
  TORCH_CHECK(group == 1 || (raw.is_contiguous() && raw.size(0) % group == 0), "ggml: rows grouped by ", group,
              " need a contiguous raw with a multiple of ", group, " rows (it has ", raw.size(0), ")");
  return {raw.data_ptr<uint8_t>(), raw.stride(0), group, bi.bytes};
}

}  // namespace

// raw: uint8 [rows, cols / block_elems * block_bytes], rows grouped by `group` (see Layout) -> [rows, cols] in
// dtype (float32, bfloat16, float16)
at::Tensor ggml_dequantize(const at::Tensor& raw, int64_t ggml_type, int64_t cols, at::ScalarType dtype,
                           int64_t group) {
  const Layout w = checked_layout(raw, ggml_type, cols, -1, group);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "ggml_dequantize: dtype must be float32, bfloat16 or float16");
  const int64_t rows = raw.size(0);
  at::Tensor out = at::empty({rows, cols}, raw.options().dtype(dtype));
  if (rows == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "ggml_dequantize", [&] {
    dequantize_impl<scalar_t>(w, ggml_type, rows, cols, out.data_ptr<scalar_t>());
  });
  return out;
}

// out[M, N] = x[M, K] @ dequant(raw[N, ...])^T (+ bias[N]) with x quantized to q8_0 / q8_K per row (see the top of
// the file). out's rows may be strided (a column slice of a wider output); x contiguous in float32, bfloat16 or
// float16; bias contiguous float32, added before the one rounding to out's dtype (saves a separate add per call).
void ggml_mm(at::Tensor& out, const at::Tensor& x, const at::Tensor& raw, int64_t ggml_type, int64_t group,
             const std::optional<at::Tensor>& bias, int64_t act_levels) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "ggml_mm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous(), "ggml_mm: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(out.size(0) == x.size(0) && (out.stride(1) == 1 || out.size(1) <= 1),
              "ggml_mm: out must be [M, N] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "ggml_mm: out and x must have the same dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "ggml_mm: x must be float32, bfloat16 or float16");
  TORCH_CHECK(act_levels == 1 || act_levels == 2, "ggml_mm: act_levels must be 1 or 2, not ", act_levels);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const Layout w = checked_layout(raw, ggml_type, K, N, group);
  if (M == 0 || N == 0) return;
  const int64_t ldo = out.stride(0);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "ggml_mm: bias must be a contiguous float32 vector of ", N, " (out's columns)");
    bp = bias->data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "ggml_mm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    switch (ggml_type) {
      case kQ4_0: mm_impl<LegacyUnsigned<kQ4_0>>(op, ldo, xp, M, K, w, N, bp, act_levels); break;
      case kQ4_1: mm_impl<LegacyUnsigned<kQ4_1>>(op, ldo, xp, M, K, w, N, bp, act_levels); break;
      case kQ5_0: mm_impl<LegacyUnsigned<kQ5_0>>(op, ldo, xp, M, K, w, N, bp, act_levels); break;
      case kQ8_0: mm_impl<Q8_0Kernel>(op, ldo, xp, M, K, w, N, bp, act_levels); break;
      case kQ4_K: mm_impl<KQuant45<kQ4_K>>(op, ldo, xp, M, K, w, N, bp, act_levels); break;
      case kQ5_K: mm_impl<KQuant45<kQ5_K>>(op, ldo, xp, M, K, w, N, bp, act_levels); break;
      case kQ6_K: mm_impl<Q6_KKernel>(op, ldo, xp, M, K, w, N, bp, act_levels); break;
      default: break;  // checked_layout rejected it
    }
  });
}

bool ggml_mm_tiles(int64_t ggml_type) {
  switch (ggml_type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return QS_GGML_TILES;
    default: return false;
  }
}

}  // namespace qwenserve::cpu

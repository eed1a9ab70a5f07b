// The ggml kernels' NEON base on aarch64: the int8 dot product every ARM kernel builds on (sdot where the CPU has
// dotprod, widening multiplies where it does not), each kernel type's block decoder into signed int8 codes, the
// activation quantizers (q8_0, q8_K) and block dequantizing. Every result here equals the scalar reference's
// (ggml/quants_ref.h) bit for bit: the same integer codes, the same float operations per value.
//
// Codes are signed: sdot multiplies s8 by s8, so the legacy types' fixed offsets (Q4_0's 8, Q5_0's 16) and Q6_K's
// 32 are taken off the codes as they are decoded, and the sums need no correction from the activation block's
// sums (the integer per block is the same as the reference's, which subtracts off * sum y instead).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_features.h"
#include "ggml/common.h"

#if QS_ARM_NEON

namespace qwenserve::cpu::ggml::arm {

// acc + the products a[i] b[i], 4 per int32 lane. With dotprod one sdot (lane k: bytes 4k..4k+3); without, the
// int16 products (exact: |a b| <= 128 * 128) summed pairwise into the lanes, so the lanes hold other groupings of
// the same 16 products: callers use only the sum of the lanes, or a scale common to all four.
inline int32x4_t dot_s8(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if QS_ARM_DOTPROD
  return vdotq_s32(acc, a, b);
#else
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

inline int8x16_t load16(const int8_t* p) { return vld1q_s8(p); }

// the fp16 at p + r * ld for r = 0..3, as 4 floats
inline float32x4_t fp16x4(const uint8_t* p, int64_t ld) {
  uint16_t h[4];
  for (int r = 0; r < 4; ++r) std::memcpy(&h[r], p + r * ld, 2);
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
}

// float -> fp16 -> float: the rounding to nearest even of c10::Half's conversion (ggml stores q8_0's d as fp16)
inline float round_to_fp16(float v) { return static_cast<float>(static_cast<__fp16>(v)); }

// ---------------------------------------------------------------------------------------------------------------
// Block decoders: one kernel type's block -> signed codes in 16-byte vectors (vector v: weights 16 v .. 16 v + 15)

// Q4_0, Q4_1 and Q5_0: 16 packed bytes -> the low nibbles (weights 0..15), the high nibbles (16..31), less the
// type's offset
template <int64_t Type>
inline void decode_legacy(const uint8_t* blk, int8x16_t* q) {
  using Kernel = LegacyUnsigned<Type>;
  const uint8x16_t packed = vld1q_u8(blk + Kernel::kQs), low4 = vdupq_n_u8(0x0F);
  uint8x16_t lo = vandq_u8(packed, low4), hi = vshrq_n_u8(packed, 4);
  if constexpr (Type == kQ5_0) {  // byte i of the 32 gets 0x10 where bit i of the LE uint32 at blk + 2 is set
    uint32_t h;
    std::memcpy(&h, blk + 2, 4);
    const uint8x16_t bytes = vreinterpretq_u8_u32(vdupq_n_u32(h));  // h's bytes 0..3, four times
    const uint8x16_t first = vqtbl1q_u8(bytes, vcombine_u8(vdup_n_u8(0), vdup_n_u8(1)));  // byte i <- byte i / 8
    const uint8x16_t second = vqtbl1q_u8(bytes, vcombine_u8(vdup_n_u8(2), vdup_n_u8(3)));
    const uint8x16_t bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ULL));  // byte i: bit i % 8
    const uint8x16_t fifth = vdupq_n_u8(0x10);
    lo = vorrq_u8(lo, vandq_u8(vtstq_u8(first, bit), fifth));
    hi = vorrq_u8(hi, vandq_u8(vtstq_u8(second, bit), fifth));
  }
  const int8x16_t off = vdupq_n_s8(static_cast<int8_t>(Kernel::kOff));
  q[0] = vsubq_s8(vreinterpretq_s8_u8(lo), off);
  q[1] = vsubq_s8(vreinterpretq_s8_u8(hi), off);
}

inline void decode_q8_0(const uint8_t* blk, int8x16_t* q) {
  const int8_t* p = reinterpret_cast<const int8_t*>(blk + 2);
  q[0] = vld1q_s8(p);
  q[1] = vld1q_s8(p + 16);
}

// Q4_K / Q5_K's 8 six-bit scales and 8 mins from their 12 packed bytes (ggml's get_scale_min_k4), four at a time:
// bytes 0-3 hold scales 0-3 and (top 2 bits) the high bits of scales 4-7; bytes 4-7 mins 0-3 and the high bits of
// mins 4-7; bytes 8-11 the low nibbles of scales 4-7 and (high nibbles) of mins 4-7
inline void unpack_scales_mins(const uint8_t* packed, uint8_t* scales, uint8_t* mins) {
  uint32_t w[3], sc[2], mn[2];
  std::memcpy(w, packed, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  sc[0] = w[0] & kLow6;
  sc[1] = (w[2] & kLow4) | (((w[0] >> 6) & kLow2) << 4);
  mn[0] = w[1] & kLow6;
  mn[1] = ((w[2] >> 4) & kLow4) | (((w[1] >> 6) & kLow2) << 4);
  std::memcpy(scales, sc, 8);
  std::memcpy(mins, mn, 8);
}

// Q4_K (Type kQ4_K) and Q5_K codes of a super-block: chunk c of 32 packed bytes holds sub-block 2c in its low
// nibbles and 2c + 1 in its high nibbles; Q5_K's fifth bit of weight 32 s + l is bit s of qh[l]
template <int64_t Type>
inline void decode_k45(const uint8_t* blk, int8x16_t* q) {
  const uint8_t* qs = blk + KQuant45<Type>::kQs;
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  uint8x16_t qh[2];
  if constexpr (Type == kQ5_K) {
    qh[0] = vld1q_u8(blk + 16);
    qh[1] = vld1q_u8(blk + 32);
  }
  for (int c = 0; c < 4; ++c)
    for (int h = 0; h < 2; ++h) {
      const uint8x16_t packed = vld1q_u8(qs + 32 * c + 16 * h);
      uint8x16_t lo = vandq_u8(packed, low4), hi = vshrq_n_u8(packed, 4);
      if constexpr (Type == kQ5_K) {
        const uint8x16_t fifth = vdupq_n_u8(0x10);
        lo = vorrq_u8(lo, vandq_u8(vtstq_u8(qh[h], vdupq_n_u8(static_cast<uint8_t>(1u << (2 * c)))), fifth));
        hi = vorrq_u8(hi, vandq_u8(vtstq_u8(qh[h], vdupq_n_u8(static_cast<uint8_t>(2u << (2 * c)))), fifth));
      }
      q[4 * c + h] = vreinterpretq_s8_u8(lo);
      q[4 * c + 2 + h] = vreinterpretq_s8_u8(hi);
    }
}

// Q6_K codes less 32 (see common.h): per half h of 128 weights, vectors 8h .. 8h + 7 from ql[64h .. 64h + 63]
// and qh[32h .. 32h + 31]
inline void decode_q6_k(const uint8_t* blk, int8x16_t* q) {
  const uint8x16_t low4 = vdupq_n_u8(0x0F), two = vdupq_n_u8(0x30);
  const int8x16_t off = vdupq_n_s8(32);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 2; ++k) {  // l = 16 k .. 16 k + 15
      const uint8x16_t ql0 = vld1q_u8(blk + 64 * h + 16 * k), ql1 = vld1q_u8(blk + 64 * h + 32 + 16 * k);
      const uint8x16_t hb = vld1q_u8(blk + 128 + 32 * h + 16 * k);
      const uint8x16_t w0 = vorrq_u8(vandq_u8(ql0, low4), vandq_u8(vshlq_n_u8(hb, 4), two));
      const uint8x16_t w1 = vorrq_u8(vandq_u8(ql1, low4), vandq_u8(vshlq_n_u8(hb, 2), two));
      const uint8x16_t w2 = vorrq_u8(vshrq_n_u8(ql0, 4), vandq_u8(hb, two));
      const uint8x16_t w3 = vorrq_u8(vshrq_n_u8(ql1, 4), vandq_u8(vshrq_n_u8(hb, 2), two));
      int8x16_t* out = q + 8 * h + k;
      out[0] = vsubq_s8(vreinterpretq_s8_u8(w0), off);
      out[2] = vsubq_s8(vreinterpretq_s8_u8(w1), off);
      out[4] = vsubq_s8(vreinterpretq_s8_u8(w2), off);
      out[6] = vsubq_s8(vreinterpretq_s8_u8(w3), off);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Activation quantizers: quants_ref.cpp's quantize_row_q8_0 / quantize_row_q8_K with the same float operations,
// 4 lanes at a time (so the same codes and scales)

template <typename T>
inline void load32_float(const T* x, float* v, int64_t n) {
  if constexpr (std::is_same_v<T, float>) std::memcpy(v, x, static_cast<size_t>(n) * sizeof(float));
  else load_float(v, x, n);
}

template <typename T>
void quantize_row_q8_0(const T* x, int64_t nb, ActQ8_0* y) {
  for (int64_t b = 0; b < nb; ++b) {
    float v[32];
    load32_float(x + 32 * b, v, 32);
    float32x4_t f[8], amax = vdupq_n_f32(0.0f);
    for (int k = 0; k < 8; ++k) {
      f[k] = vld1q_f32(v + 4 * k);
      amax = vmaxq_f32(amax, vabsq_f32(f[k]));
    }
    const float d = vmaxvq_f32(amax) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32x4_t q[8];
    for (int k = 0; k < 8; ++k) q[k] = vcvtaq_s32_f32(vmulq_n_f32(f[k], id));  // half away from zero, as std::round
    for (int k = 0; k < 8; k += 4) {
      const int16x8_t lo = vcombine_s16(vmovn_s32(q[k]), vmovn_s32(q[k + 1]));
      const int16x8_t hi = vcombine_s16(vmovn_s32(q[k + 2]), vmovn_s32(q[k + 3]));
      vst1q_s8(y[b].qs + 4 * k, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
    }
    // vector k holds quad k (codes 4k .. 4k + 3)
    const int32x4_t even = vaddq_s32(vaddq_s32(q[0], q[2]), vaddq_s32(q[4], q[6]));
    const int32x4_t odd = vaddq_s32(vaddq_s32(q[1], q[3]), vaddq_s32(q[5], q[7]));
    y[b].quad_sums[0] = vaddvq_s32(even);
    y[b].quad_sums[1] = vaddvq_s32(odd);
    y[b].sum = y[b].quad_sums[0] + y[b].quad_sums[1];
    y[b].d = round_to_fp16(d);
  }
}

template <typename T>
void quantize_row_q8_K(const T* x, int64_t nb, ActQ8_K* y) {
  for (int64_t b = 0; b < nb; ++b) {
    float v[256];
    load32_float(x + 256 * b, v, 256);
    float32x4_t amax4 = vdupq_n_f32(0.0f);
    for (int k = 0; k < 64; ++k) amax4 = vmaxq_f32(amax4, vabsq_f32(vld1q_f32(v + 4 * k)));
    const float amax = vmaxvq_f32(amax4);
    ActQ8_K& a = y[b];
    if (amax == 0.0f) {
      std::memset(&a, 0, sizeof(a));
      continue;
    }
    int first = 0;  // the signed value of largest magnitude (the first one), as the reference picks it
    while (std::fabs(v[first]) != amax) ++first;
    const float iscale = -127.0f / v[first];
    for (int k = 0; k < 16; ++k) {  // codes 16k .. 16k + 15: ties to even, as nearbyint; at most 127
      int32x4_t q[4];
      for (int j = 0; j < 4; ++j)
        q[j] = vminq_s32(vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(v + 16 * k + 4 * j), iscale)), vdupq_n_s32(127));
      const int16x8_t lo = vcombine_s16(vmovn_s32(q[0]), vmovn_s32(q[1]));
      const int16x8_t hi = vcombine_s16(vmovn_s32(q[2]), vmovn_s32(q[3]));
      vst1q_s8(a.qs + 16 * k, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
      a.bsums[k] = static_cast<int16_t>(vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3]))));
    }
    for (int j = 0; j < 8; ++j) a.bsums32[j] = static_cast<int16_t>(a.bsums[2 * j] + a.bsums[2 * j + 1]);
    a.d = 1.0f / iscale;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantizing: a block -> floats with the reference's operations (every product exact in float32; only Q4_1's
// and the K-quants' final addition rounds, once, fused or not), then stored in the output dtype

inline void store4(float* o, float32x4_t v) { vst1q_f32(o, v); }
inline void store4(c10::BFloat16* o, float32x4_t v) {  // from_float's rounding (to nearest even; NaN -> 0x7FC0)
  const uint32x4_t u = vreinterpretq_u32_f32(v);
  const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)),
                                                   vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1))), 16);
  const uint32x4_t bits = vbslq_u32(vceqq_f32(v, v), rounded, vdupq_n_u32(0x7FC0));
  vst1_u16(reinterpret_cast<uint16_t*>(o), vmovn_u32(bits));
}
inline void store4(c10::Half* o, float32x4_t v) {  // to nearest even, as c10::Half(float)
  vst1_u16(reinterpret_cast<uint16_t*>(o), vreinterpret_u16_f16(vcvt_f16_f32(v)));
}

// 16 signed codes as float32, 4 vectors
inline void code_floats(int8x16_t q, float32x4_t* f) {
  const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
  f[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
  f[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
  f[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
  f[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}

// n vectors of codes (vector v: weights 16 v .. 16 v + 15) -> out, scale * code (+ add): without an addend a plain
// product, as the reference's (an added 0.0f would turn its -0.0f into +0.0f)
template <bool kAdd, typename T>
inline void store_scaled(const int8x16_t* q, int n, float scale, float add, T* out) {
  for (int v = 0; v < n; ++v) {
    float32x4_t f[4];
    code_floats(q[v], f);
    for (int k = 0; k < 4; ++k)
      store4(out + 16 * v + 4 * k, kAdd ? vfmaq_n_f32(vdupq_n_f32(add), f[k], scale) : vmulq_n_f32(f[k], scale));
  }
}

template <typename T>
void dequantize_block(int64_t type, const uint8_t* b, T* out) {
  int8x16_t q[16];
  switch (type) {
    case kQ4_0: decode_legacy<kQ4_0>(b, q); store_scaled<false>(q, 2, fp16_at(b), 0.0f, out); break;
    case kQ5_0: decode_legacy<kQ5_0>(b, q); store_scaled<false>(q, 2, fp16_at(b), 0.0f, out); break;
    case kQ8_0: decode_q8_0(b, q); store_scaled<false>(q, 2, fp16_at(b), 0.0f, out); break;
    case kQ4_1: decode_legacy<kQ4_1>(b, q); store_scaled<true>(q, 2, fp16_at(b), fp16_at(b + 2), out); break;
    case kQ4_K:
    case kQ5_K: {
      if (type == kQ4_K) decode_k45<kQ4_K>(b, q);
      else decode_k45<kQ5_K>(b, q);
      uint8_t sc[8], mn[8];
      unpack_scales_mins(b + 4, sc, mn);
      const float d = fp16_at(b), dmin = fp16_at(b + 2);
      for (int s = 0; s < 8; ++s) {  // d sc q - dmin m: the product exact, the subtraction the one rounding
        const float scale = d * static_cast<float>(sc[s]), min = dmin * static_cast<float>(mn[s]);
        store_scaled<true>(q + 2 * s, 2, scale, -min, out + 32 * s);
      }
      break;
    }
    case kQ6_K: {
      decode_q6_k(b, q);
      const float d = fp16_at(b + 208);
      for (int j = 0; j < 16; ++j)
        store_scaled<false>(q + j, 1, d * static_cast<float>(static_cast<int8_t>(b[192 + j])), 0.0f, out + 16 * j);
      break;
    }
    default: break;
  }
}

}  // namespace qwenserve::cpu::ggml::arm

#endif  // QS_ARM_NEON

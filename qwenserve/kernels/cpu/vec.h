// Shared inline helpers for the CPU kernels: bf16/fp16 rounding, a vectorisable exp, float loads and the
// fixed-width lane reductions, plus the AVX-512 16-wide loads. Roundings follow HF transformers' order of
// operations in the activation dtype, so bfloat16 results match the PyTorch path bit for bit where the PyTorch
// path rounds, and float32 results agree to float rounding. The loops are written as fixed-width lanes so the
// compiler vectorises them without -ffast-math (which would reorder the sums and break the bit-equality). Every
// x86 intrinsic sits under QS_X86_AVX512F (or, for the 8-wide loads, QS_X86_AVX2; see cpu_features.h), so the
// same sources build the portable path anywhere else; everything here is inline, so each op family's translation
// unit can include it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_features.h"

namespace qwenserve::cpu {

inline constexpr int kLanes = 16;

// float -> T, rounding to nearest even as PyTorch does. c10's own bfloat16 conversion branches on NaN, which
// keeps loops around it scalar; this one selects instead, so they vectorise.
template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

// A value stored as T and read back: the rounding PyTorch applies after every op in dtype T.
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(from_float<T>(v));
}

// Vectorisable exp: Cephes' polynomial after range reduction, the rounding done with the 1.5 * 2^23 trick
// (plain arithmetic, no library call, so loops over it vectorise). Relative error ~2e-7 over [-87, 88.7]; below
// -87 it gives exp(-87), above 88.7 infinity, as expf overflows. The top is bounded through n, not by clamping x:
// with x clamped to a constant the compiler evaluates a caller's g / (1 + exp_approx(-g)) at that constant for
// every lane and blends, and g / 1.6e38 is a subnormal, which costs Intel cores a microcode assist per vector
// (SiLU over 4,864 floats: 46 us instead of 5 on a Xeon).
inline float exp_approx(float x) {
  x = std::max(x, -87.0f);
  const float magic = 12582912.0f;
  float n = std::min((x * 1.44269504088896341f + magic) - magic, 128.0f);  // 2^128: the exponent bits of inf
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline void load_float(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// An fp8 code (kMantissa bits, exponent bias kBias) as a float, from integer ops and a bit mask so loops over it
// vectorise (c10's conversion branches); exact, with no float denormal on the way (flush-to-zero would zero it).
// The formats' inf / NaN codes read as large finite numbers: a KV cache never holds them (codes are clamped).
template <int kMantissa, int kBias>
inline float fp8_to_float(uint8_t code) {
  const uint32_t magnitude = code & 0x7Fu;
  const float subnormal = static_cast<float>(magnitude) * (1.0f / static_cast<float>(1u << (kBias + kMantissa - 1)));
  uint32_t subnormal_bits;
  std::memcpy(&subnormal_bits, &subnormal, sizeof(subnormal_bits));
  const uint32_t normal_bits = (magnitude << (23 - kMantissa)) + ((127u - kBias) << 23);
  const uint32_t normal = 0u - static_cast<uint32_t>(magnitude >> kMantissa != 0);  // all ones: a normal code
  const uint32_t bits = (normal_bits & normal) | (subnormal_bits & ~normal) | ((code & 0x80u) << 24);
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
inline void load_float(float* dst, const c10::Float8_e4m3fn* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp8_to_float<3, 7>(src[i].x);
}
inline void load_float(float* dst, const c10::Float8_e5m2* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp8_to_float<2, 15>(src[i].x);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float sum = 0;
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline float sum_of_squares(const float* a, int64_t n) { return dot(a, a, n); }

inline float max_of(const float* a, int64_t n) {
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, -INFINITY);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], a[i + j]);
  float m = -INFINITY;
  for (int j = 0; j < kLanes; ++j) m = std::max(m, lanes[j]);
  for (; i < n; ++i) m = std::max(m, a[i]);
  return m;
}

inline float sum_of(const float* a, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += a[i + j];
  float sum = 0;
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  for (; i < n; ++i) sum += a[i];
  return sum;
}

inline void check_cpu_contiguous_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

#if QS_X86_AVX512F
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// KV cache codes (kv_cache_dtype): widened exactly; their scales are applied by the caller.
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m256i load16_bytes_as_u16(const void* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// e5m2 is the top byte of a float16
inline __m512 load16(const c10::Float8_e5m2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(load16_bytes_as_u16(p), 8));
}
// e4m3fn (bias 7) as a float16 (bias 15): sign to bit 15, exponent and mantissa to bits 7-13, then x 2^8 for the
// bias; its subnormals become float16 subnormals, which the conversion widens exactly. (Its NaN, 0x7f, reads as
// 480; the cache never holds one: codes are clamped to +-448.)
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i b = load16_bytes_as_u16(p);
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
// element types with a 16-wide AVX-512 load above (double takes the portable path)
template <typename T>
inline constexpr bool kWideLoad = !std::is_same_v<T, double>;
#elif QS_X86_AVX2
// The same loads 8 wide, for AVX2 machines (every one has FMA and F16C; each AVX2 variant turns on all three).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m128i load8_bytes_as_u16(const void* p) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::Float8_e5m2* p) { return _mm256_cvtph_ps(_mm_slli_epi16(load8_bytes_as_u16(p), 8)); }
inline __m256 load8(const c10::Float8_e4m3fn* p) {  // as load16 for AVX-512 does it
  const __m128i b = load8_bytes_as_u16(p);
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
template <typename T>
inline constexpr bool kWideLoad = !std::is_same_v<T, double>;
#endif

}  // namespace qwenserve::cpu

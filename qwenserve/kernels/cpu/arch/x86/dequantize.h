// ggml blocks -> floats on x86 (ggml_dequantize): each kernel type's AVX2 decoder gives the codes in registers,
// then 8 (AVX2) or 16 (AVX-512) at a time they become floats with the same operations as the reference's
// dequantize_block (so the same bits), and are stored in the output dtype. The dense route of the quantized
// layers dequantizes every weight once per call (each prefill step, and each decode step from 32 rows where the
// CPU has native bf16): done a block at a time through the reference's scalar loops it costs more than the
// matmul itself.
#pragma once

#include <cstdint>

#include "arch/x86/avx2.h"
#include "cpu_features.h"
#include "ggml/common.h"

#if QS_X86_AVX2

namespace qwenserve::cpu::ggml::x86 {

// Codes as floats, 8 (AVX2) or 16 (AVX-512) at a time. The value functions below use GCC's vector operators
// (a scalar operand is broadcast), so one body serves both widths.
template <int Part, bool Signed>
inline __m256 code_floats8(__m256i q) {  // bytes 8 Part .. 8 Part + 7
  const __m128i half = Part < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
  const __m128i b = Part % 2 ? _mm_unpackhi_epi64(half, half) : half;
  return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
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

#if QS_X86_AVX512BW
template <int Half, bool Signed>
inline __m512 code_floats16(__m256i q) {  // bytes 16 Half .. 16 Half + 15
  const __m128i b = Half ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
  return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
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
#if QS_X86_AVX512BW
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
  using Kernel = LegacyUnsigned<Type>;
  const float d = fp16_at(b);
  if constexpr (Type == kQ8_0) {
    store_codes32<true>(o, load32(b + 2), [&](auto f, int) { return f * d; });
  } else if constexpr (Type == kQ4_1) {
    const float m = fp16_at(b + 2);
    store_codes32<false>(o, Avx2Kernel<Kernel>::decode(b).q, [&](auto f, int) { return f * d + m; });
  } else {
    constexpr float off = Kernel::kOff;
    store_codes32<false>(o, Avx2Kernel<Kernel>::decode(b).q, [&](auto f, int) { return (f - off) * d; });
  }
}

template <int64_t Type, typename T>
void dequantize_k45(const uint8_t* b, T* o) {
  const typename Avx2Kernel<KQuant45<Type>>::Codes c = Avx2Kernel<KQuant45<Type>>::decode(b);
  const float d = fp16_at(b), dmin = fp16_at(b + 2);
  for (int s = 0; s < 8; ++s) {  // sub-block s: x = (d sc[s]) q - dmin m[s], the product exact
    const float ds = d * static_cast<float>(c.scales[s]), dm = dmin * static_cast<float>(c.scales[8 + s]);
    store_codes32<false>(o + 32 * s, s % 2 ? c.hi[s / 2] : c.lo[s / 2], [&](auto f, int) { return f * ds - dm; });
  }
}

template <typename T>
void dequantize_q6_k(const uint8_t* b, T* o) {
  const Avx2Kernel<Q6_KKernel>::Codes c = Avx2Kernel<Q6_KKernel>::decode(b);
  const float d = fp16_at(b + 208);
  for (int i = 0; i < 8; ++i) {  // weights 32 i ..: sub-blocks 2 i and 2 i + 1 of 16, x = (d sc) (q - 32)
    const float ds[2] = {d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * i])),
                         d * static_cast<float>(static_cast<int8_t>(b[193 + 2 * i]))};
    store_codes32<false>(o + 32 * i, c.q[i], [&](auto f, int h) { return (f - 32.0f) * ds[h]; });
  }
}

// one block -> o[0 .. block elements - 1] (T: float, c10::BFloat16, c10::Half)
template <typename T>
void dequantize_block(int64_t type, const uint8_t* b, T* o) {
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

}  // namespace qwenserve::cpu::ggml::x86

#endif  // QS_X86_AVX2

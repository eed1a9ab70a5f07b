// The scalar reference (see quants_ref.h). Nothing here depends on the instruction set: the same code is built
// on every CPU, whether or not dispatch.cpp has faster kernels for it.

#include "ggml/quants_ref.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace qwenserve::cpu::ggml::ref {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Weight codes, one block at a time

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

// ggml's nearest_int (round to nearest, ties to even) of the float32 product iscale * x. Not its "+ 1.5 * 2^23"
// trick: the compiler may fuse that add with the product (an fma), which rounds once where ggml rounds twice.
inline int nearest_int(float f) { return static_cast<int>(std::nearbyint(f)); }

// ---------------------------------------------------------------------------------------------------------------
// Dot products, one kernel type at a time (the sums common.h describes)

template <int64_t Type, int R>
void dot_legacy(const uint8_t* w, int64_t bstride, int64_t nb, const ActQ8_0* const* y, float* res) {
  using Kernel = LegacyUnsigned<Type>;
  float acc[R] = {}, accm[R] = {};
  int32_t q[32];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bstride;
    const float dw = fp16_at(blk), mw = Type == kQ4_1 ? fp16_at(blk + 2) : 0.0f;
    if constexpr (Type == kQ5_0) codes_q5_0(blk, q);
    else codes_nibbles(blk + Kernel::kQs, q);
    for (int r = 0; r < R; ++r) {
      const ActQ8_0& a = y[r][b];
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) s += q[j] * a.qs[j];
      s -= Kernel::kOff * a.sum;
      acc[r] += (dw * a.d) * static_cast<float>(s);
      if constexpr (Type == kQ4_1) accm[r] += (mw * a.d) * static_cast<float>(a.sum);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = acc[r] + accm[r];
}

template <int R>
void dot_q8_0(const uint8_t* w, int64_t bstride, int64_t nb, const ActQ8_0* const* y, float* res) {
  float acc[R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bstride;
    const float dw = fp16_at(blk);
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int r = 0; r < R; ++r) {
      const ActQ8_0& a = y[r][b];
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) s += q[j] * a.qs[j];
      acc[r] += (dw * a.d) * static_cast<float>(s);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = acc[r];
}

template <int64_t Type, int R>
void dot_k45(const uint8_t* w, int64_t bstride, int64_t nb, const ActQ8_K* const* y, float* res) {
  float acc[R] = {}, accm[R] = {};
  int32_t q[256], sc[8], mn[8];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bstride;
    const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
    scales_mins_k(blk + 4, sc, mn);
    codes_k4_k5(blk + KQuant45<Type>::kQs, Type == kQ5_K ? blk + 16 : nullptr, q);
    for (int r = 0; r < R; ++r) {
      const ActQ8_K& a = y[r][b];
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

template <int R>
void dot_q6_k(const uint8_t* w, int64_t bstride, int64_t nb, const ActQ8_K* const* y, float* res) {
  float acc[R] = {};
  int32_t q[256];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bstride;
    const float d = fp16_at(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    codes_q6_k(blk, q);
    for (int r = 0; r < R; ++r) {
      const ActQ8_K& a = y[r][b];
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

}  // namespace

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

template <typename T>
void quantize_row_q8_0(const T* x, int64_t nb, ActQ8_0* y) {
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

template <typename Kernel, int R>
void dot_rows(const uint8_t* w, int64_t bstride, int64_t nb, const typename Kernel::Act* const* y, float* res) {
  if constexpr (Kernel::kType == kQ8_0) dot_q8_0<R>(w, bstride, nb, y, res);
  else if constexpr (Kernel::kBlock == 32) dot_legacy<Kernel::kType, R>(w, bstride, nb, y, res);
  else if constexpr (Kernel::kType == kQ6_K) dot_q6_k<R>(w, bstride, nb, y, res);
  else dot_k45<Kernel::kType, R>(w, bstride, nb, y, res);
}

// The instances dispatch.cpp calls: the activation dtypes ggml_mm takes (and float32 for the second level's
// remainders), every kernel type, 1 to 4 activation rows
#define QS_REF_QUANTIZE(T)                                                  \
  template void quantize_row_q8_0<T>(const T*, int64_t, ActQ8_0*);          \
  template void quantize_row_q8_K<T>(const T*, int64_t, ActQ8_K*);
QS_REF_QUANTIZE(float)
QS_REF_QUANTIZE(c10::BFloat16)
QS_REF_QUANTIZE(c10::Half)
#undef QS_REF_QUANTIZE

#define QS_REF_DOT(K, R) \
  template void dot_rows<K, R>(const uint8_t*, int64_t, int64_t, const K::Act* const*, float*);
#define QS_REF_DOTS(K) QS_REF_DOT(K, 1) QS_REF_DOT(K, 2) QS_REF_DOT(K, 3) QS_REF_DOT(K, 4)
QS_REF_DOTS(LegacyUnsigned<kQ4_0>)
QS_REF_DOTS(LegacyUnsigned<kQ4_1>)
QS_REF_DOTS(LegacyUnsigned<kQ5_0>)
QS_REF_DOTS(Q8_0Kernel)
QS_REF_DOTS(KQuant45<kQ4_K>)
QS_REF_DOTS(KQuant45<kQ5_K>)
QS_REF_DOTS(Q6_KKernel)
#undef QS_REF_DOTS
#undef QS_REF_DOT

}  // namespace qwenserve::cpu::ggml::ref

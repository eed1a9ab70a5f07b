// The drivers ggml_mm (dispatch.cpp) and ggml_moe (experts.cpp) share: activation rows quantized to q8_0 / q8_K
// blocks, and a matmul of quantized activation rows against weight rows by whichever kernel suits the row count,
// the layout and the build (the top of dispatch.cpp says which runs when). Templates and inline functions only, so
// both sources compile their own copies.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "ggml/common.h"
#include "ggml/quants_ref.h"

#if QS_X86_AVX2
#include "arch/x86/amx_bf16_tiles.h"
#include "arch/x86/amx_tiles.h"
#include "arch/x86/avx2.h"
#include "arch/x86/avx2_tiles.h"
#include "arch/x86/avx512.h"
#include "arch/x86/dequantize.h"
#include "arch/x86/vnni_tiles.h"
#elif QS_ARM_NEON
#include "arch/arm/dotprod.h"
#include "arch/arm/i8mm.h"
#include "arch/arm/neon.h"
#endif

// The activation dtypes the entry points take (they reject any other before dispatching)
#define QS_GGML_DISPATCH_DTYPES(TYPE, NAME, ...)                                   \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)         \
                                 AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)      \
                                 AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace qwenserve::cpu::ggml {

// ---------------------------------------------------------------------------------------------------------------
// Activation rows

template <typename T>
void quantize_row(const T* x, int64_t K, ActQ8_0* y) {
#if QS_X86_AVX512BW
  x86::quantize_row_q8_0(x, K / 32, y);
#elif QS_ARM_NEON
  arm::quantize_row_q8_0(x, K / 32, y);
#else
  ref::quantize_row_q8_0(x, K / 32, y);
#endif
}
template <typename T>
void quantize_row(const T* x, int64_t K, ActQ8_K* y) {
#if QS_X86_AVX2
  x86::quantize_row_q8_K(x, K / 256, y);
#elif QS_ARM_NEON
  arm::quantize_row_q8_K(x, K / 256, y);
#else
  ref::quantize_row_q8_K(x, K / 256, y);
#endif
}

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

// ---------------------------------------------------------------------------------------------------------------
// Weight rows against activation rows

// One weight row against R activation rows
template <typename Kernel, int R>
inline void dot_rows(const uint8_t* w, int64_t bstride, int64_t nb, const typename Kernel::Act* const* y,
                     float* res) {
#if QS_X86_AVX2
  x86::dot_rows<Kernel, R>(w, bstride, nb, y, res);
#elif QS_ARM_NEON
  arm::dot_rows<Kernel, R>(w, bstride, nb, y, res);
#else
  ref::dot_rows<Kernel, R>(w, bstride, nb, y, res);
#endif
}

#if QS_X86_AVX2
// One group of 8 weight rows in the decode layout against R activation rows: the widest kernel this build has.
template <typename Kernel, int R>
void decode_group(const uint8_t* w, int64_t nb, const typename Kernel::Act* const* y, float (*res)[8]) {
#if QS_X86_AVX512BW
  if constexpr (x86::kWide512<Kernel>) {
    x86::dot8_legacy512<Kernel, R>(w, nb, y, res);
    return;
  }
  if constexpr (x86::kWideK512<Kernel> && R <= 2) {  // 3 or 4 rows' vectors would not fit the registers
    x86::dot8_kquant512<Kernel, R>(w, nb, y, res);
    return;
  }
#endif
  x86::dot8<Kernel, R>(w, nb, y, res);
}
#elif QS_ARM_NEON
template <typename Kernel, int R>
void decode_group(const uint8_t* w, int64_t nb, const typename Kernel::Act* const* y, float (*res)[8]) {
  arm::dot8<Kernel, R>(w, nb, y, res);
}
#endif

#if QS_X86_AVX2 || QS_ARM_NEON
// Weight groups g0 .. g1 (8 rows each, the decode layout) against all M activation rows, 4 at a time, -> out
template <typename Kernel, typename T>
void decode_groups(T* out, int64_t ldo, int64_t levels, const typename Kernel::Act* act, int64_t M, int64_t nb,
                   const Layout& w, int64_t g0, int64_t g1, const float* bias) {
  using Act = typename Kernel::Act;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int r = static_cast<int>(std::min<int64_t>(4, M - m0));
      const Act* y[4];
      for (int i = 0; i < r; ++i) y[i] = act + (m0 + i) * nb;
      float res[4][8];
      switch (r) {
        case 4: decode_group<Kernel, 4>(w.row(8 * g), nb, y, res); break;
        case 3: decode_group<Kernel, 3>(w.row(8 * g), nb, y, res); break;
        case 2: decode_group<Kernel, 2>(w.row(8 * g), nb, y, res); break;
        default: decode_group<Kernel, 1>(w.row(8 * g), nb, y, res); break;
      }
      store_rows<8>(out, ldo, levels, m0, r, 8 * g, res[0], bias);
    }
}
#endif

// Activation rows below which every build's mm_quantized runs the decode-group kernels on weights in the decode
// layout, where the build has them (the tile kernels start from 4 rows on VNNI and ARM, 6 on AVX2, Q8_0's there
// 16 without 256-bit VNNI)
constexpr int64_t kDecodeGroupRows = 4;
#if QS_X86_AMX_BUILD
static_assert(x86::kAmxMinRows >= kDecodeGroupRows);
#endif
#if QS_X86_AVX512_VNNI
static_assert(x86::kTileMinRows >= kDecodeGroupRows);
#elif QS_X86_AVX2
static_assert(x86::kAvx2TileMinRows >= kDecodeGroupRows);
#elif QS_ARM_I8MM
static_assert(arm::kTileMinRows >= kDecodeGroupRows);
#endif

// How many groups of 8 weight rows a thread takes at a time from a matmul of `groups`: about 8 chunks a thread
inline int64_t decode_chunk_groups(int64_t groups, int64_t threads) {
  return std::max<int64_t>(2, groups / (threads * 8));
}

// f((Kernel*)nullptr) with the kernel of a ggml type our kernels run (dispatch.cpp's checks reject the others)
template <typename F>
void with_kernel(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: f(static_cast<LegacyUnsigned<kQ4_0>*>(nullptr)); return;
    case kQ4_1: f(static_cast<LegacyUnsigned<kQ4_1>*>(nullptr)); return;
    case kQ5_0: f(static_cast<LegacyUnsigned<kQ5_0>*>(nullptr)); return;
    case kQ8_0: f(static_cast<Q8_0Kernel*>(nullptr)); return;
    case kQ4_K: f(static_cast<KQuant45<kQ4_K>*>(nullptr)); return;
    case kQ5_K: f(static_cast<KQuant45<kQ5_K>*>(nullptr)); return;
    case kQ6_K: f(static_cast<Q6_KKernel*>(nullptr)); return;
    default: TORCH_CHECK(false, "ggml type ", type, " is not one our kernels run");
  }
}

// out[M / levels, N] from M quantized activation rows (act: M * nb blocks, `levels` rows per output row), by
// whichever kernel suits M and the layout. Every pass below covers an even number of rows from an even one.
template <typename Kernel, typename T>
void mm_quantized(T* out, int64_t ldo, int64_t levels, const std::vector<typename Kernel::Act>& act, int64_t M,
                  int64_t nb, const Layout& w, int64_t N, const float* bias) {
  using Act = typename Kernel::Act;
  const int64_t bstride = w.block_stride();
#if QS_X86_AVX512_VNNI
  if constexpr (x86::kTiles<Kernel>) {
#if QS_X86_AMX_BUILD
    if constexpr (x86::kAmxTiles<Kernel>)
      if (w.group == kDecodeGroup && M >= x86::kAmxMinRows && N % 16 == 0 && x86::use_amx()) {
        x86::mm_amx<Kernel>(out, ldo, levels, act.data(), M, nb, w, N, bias);
        return;
      }
#endif
    if (w.group == kDecodeGroup && M >= x86::kTileMinRows) {
      if (N % 16 == 0)
        x86::mm_tiles16<Kernel>(out, ldo, levels, act.data(), M, nb, w, N, bias);
      else
        x86::mm_tiles<Kernel>(out, ldo, levels, act.data(), M, nb, w, N, bias);
      return;
    }
  }
#elif QS_X86_AVX2
  if (w.group == kDecodeGroup && M >= x86::kAvx2TileMinRowsFor<Kernel>) {
    x86::mm_avx2_tiles<Kernel>(out, ldo, levels, act.data(), M, nb, w, N, bias);
    return;
  }
#elif QS_ARM_I8MM
  if (w.group == kDecodeGroup && M >= arm::kTileMinRows) {
    arm::mm_tiles<Kernel>(out, ldo, levels, act.data(), M, nb, w, N, bias);
    return;
  }
#endif
#if QS_X86_AVX2 || QS_ARM_NEON
  if (w.group == kDecodeGroup) {  // a group of 8 weight rows at a time, against up to 4 activation rows
    // groups handed out in chunks as threads ask for them: on a shared host one core may run slower for a while,
    // and an even split leaves the other waiting at the end of every matmul
    const int64_t groups = N / 8, threads = at::get_num_threads();
    const int64_t chunk = decode_chunk_groups(groups, threads);
    const int64_t chunks = (groups + chunk - 1) / chunk;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;)
        decode_groups<Kernel>(out, ldo, levels, act.data(), M, nb, w, c * chunk, std::min(groups, (c + 1) * chunk),
                              bias);
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

// The quantized activation rows to allocate for `rows`: where the AMX kernel may take them, rounded up to 16 (its
// A tiles read whole groups of 16; the rows past `rows` stay zero), else just `rows` (a decode step's one row is
// not padded to 16)
inline int64_t activation_rows_allocated(int64_t rows) {
#if QS_X86_AMX_BUILD
  if (rows >= x86::kAmxMinRows) return (rows + 15) / 16 * 16;
#endif
  return rows;
}

}  // namespace qwenserve::cpu::ggml

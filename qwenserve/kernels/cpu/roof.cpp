// The int8 roof: the multiply-add rate of a register-only loop of the instruction sequence this build's int8 tile
// kernel runs per 4-byte group (ggml/dispatch.cpp's header says which kernel runs when), on one thread and on
// every thread at once. The kernels also load and decode weights, scale and sum in float; the loop does none of
// that, so its rate bounds their int8 arithmetic from above, and a kernel's achieved rate over it says how far the
// kernel is from what the instructions allow. One MAC is one int8 x int8 product added; the op reports 2 ops per MAC
// in GOP/s, as `qwenserve bench kernels` counts 2 M N K flops per matmul.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_features.h"
#include "ops.h"

#if QS_X86_AMX_BUILD
#include "arch/x86/amx_tiles.h"
#endif

namespace qwenserve::cpu {
namespace {

// An empty asm that claims to change a vector register, and costs no instruction: called on an operand before each
// accumulator's instructions, it keeps the compiler from computing a product once for every accumulator (their
// operands are equal) or hoisting it out of the loop, and the operand stays in a register
#if defined(__x86_64__) || defined(__i386__)
template <typename V>
inline void opaque(V& v) { asm volatile("" : "+v"(v)); }
#elif defined(__aarch64__)
template <typename V>
inline void opaque(V& v) { asm volatile("" : "+w"(v)); }
#endif

// The loop of this build: kName, kMacsPerStep (MACs of one step: one instruction sequence per accumulator) and
// run_steps, which runs `steps` steps and returns a sum of the accumulators, so that they stay live.
// kChains independent accumulators cover the instructions' latency (4-5 cycles) at their throughput (1-2 a cycle).
#if QS_X86_AVX512_VNNI
// vnni_tiles.h: _mm512_dpbusd_epi32, 64 u8 x s8 products into 16 int32 lanes
constexpr const char* kName = "vpdpbusd zmm (AVX512-VNNI, 512-bit)";
constexpr int kChains = 12;
constexpr int64_t kMacsPerStep = kChains * 64;
int64_t run_steps(int64_t steps) {
  __m512i acc[kChains];
  for (auto& a : acc) a = _mm512_setzero_si512();
  __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
  for (int64_t i = 0; i < steps; ++i) {
    opaque(u);
    #pragma GCC unroll 16  // every accumulator in a register of its own
    for (int c = 0; c < kChains; ++c) {
      opaque(s);
      acc[c] = _mm512_dpbusd_epi32(acc[c], u, s);
    }
  }
  for (int c = 1; c < kChains; ++c) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
  return _mm512_reduce_add_epi32(acc[0]);
}
#elif QS_X86_AVX512_VNNI_VL || QS_X86_AVX_VNNI
// avx2_tiles.h with 256-bit VNNI: 32 u8 x s8 products into 8 int32 lanes
constexpr const char* kName = "vpdpbusd ymm (VNNI, 256-bit)";
constexpr int kChains = 12;
constexpr int64_t kMacsPerStep = kChains * 32;
int64_t run_steps(int64_t steps) {
  __m256i acc[kChains];
  for (auto& a : acc) a = _mm256_setzero_si256();
  __m256i u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(-2);
  for (int64_t i = 0; i < steps; ++i) {
    opaque(u);
    #pragma GCC unroll 16  // every accumulator in a register of its own
    for (int c = 0; c < kChains; ++c) {
      opaque(s);
#if QS_X86_AVX512_VNNI_VL
      acc[c] = _mm256_dpbusd_epi32(acc[c], u, s);
#else
      acc[c] = _mm256_dpbusd_avx_epi32(acc[c], u, s);
#endif
    }
  }
  for (int c = 1; c < kChains; ++c) acc[0] = _mm256_add_epi32(acc[0], acc[c]);
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[0]);
  int64_t sum = 0;
  for (int32_t v : lanes) sum += v;
  return sum;
}
#elif QS_X86_AVX2
// avx2_tiles.h without VNNI, as it runs 4-bit codes: 8 quads' vpmaddubsw (u8 x s8 pairs into int16) added in int16
// (vpaddw), then one vpmaddwd (int16 pairs into int32) and vpaddd. A loop widening every product (a vpmaddwd per
// vpmaddubsw) is slower where the two share a pipe, and the tiles beat it there (docs/performance.md, the int8
// roof); types whose larger codes allow fewer quads per widening (Q6_K: 2) have a lower ceiling than this. The
// accumulators wait only on vpaddd, so 6 chains hide the latency and fit 16 ymm registers with the operands and
// the products in flight.
constexpr const char* kName = "8 x vpmaddubsw+vpaddw, vpmaddwd+vpaddd ymm (AVX2, 256-bit)";
constexpr int kChains = 6;
constexpr int kQuadsPerWidening = 8;
constexpr int64_t kMacsPerStep = kChains * kQuadsPerWidening * 32;
int64_t run_steps(int64_t steps) {
  __m256i acc[kChains];
  for (auto& a : acc) a = _mm256_setzero_si256();
  __m256i u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < steps; ++i) {
    opaque(u), opaque(ones);
    #pragma GCC unroll 16  // every accumulator in a register of its own
    for (int c = 0; c < kChains; ++c) {
      opaque(s);
      __m256i pairs = _mm256_maddubs_epi16(u, s);
      #pragma GCC unroll 8
      for (int q = 1; q < kQuadsPerWidening; ++q) {
        opaque(s);
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u, s));
      }
      acc[c] = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), acc[c]);
    }
  }
  for (int c = 1; c < kChains; ++c) acc[0] = _mm256_add_epi32(acc[0], acc[c]);
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[0]);
  int64_t sum = 0;
  for (int32_t v : lanes) sum += v;
  return sum;
}
#elif QS_ARM_I8MM
// i8mm.h: vmmlaq_s32 (smmla), a 2x8 by 8x2 s8 product into a 2x2 int32 tile: 32 products
constexpr const char* kName = "smmla (i8mm, 128-bit)";
constexpr int kChains = 12;
constexpr int64_t kMacsPerStep = kChains * 32;
int64_t run_steps(int64_t steps) {
  int32x4_t acc[kChains];
  for (auto& a : acc) a = vdupq_n_s32(0);
  int8x16_t a = vdupq_n_s8(3), b = vdupq_n_s8(-2);
  for (int64_t i = 0; i < steps; ++i) {
    opaque(a);
    #pragma GCC unroll 16  // every accumulator in a register of its own
    for (int c = 0; c < kChains; ++c) {
      opaque(b);
      acc[c] = vmmlaq_s32(acc[c], a, b);
    }
  }
  for (int c = 1; c < kChains; ++c) acc[0] = vaddq_s32(acc[0], acc[c]);
  return vaddvq_s32(acc[0]);
}
#elif QS_ARM_DOTPROD
// neon.h / dotprod.h: vdotq_s32 (sdot), 16 s8 x s8 products into 4 int32 lanes
constexpr const char* kName = "sdot (dotprod, 128-bit)";
constexpr int kChains = 12;
constexpr int64_t kMacsPerStep = kChains * 16;
int64_t run_steps(int64_t steps) {
  int32x4_t acc[kChains];
  for (auto& a : acc) a = vdupq_n_s32(0);
  int8x16_t a = vdupq_n_s8(3), b = vdupq_n_s8(-2);
  for (int64_t i = 0; i < steps; ++i) {
    opaque(a);
    #pragma GCC unroll 16  // every accumulator in a register of its own
    for (int c = 0; c < kChains; ++c) {
      opaque(b);
      acc[c] = vdotq_s32(acc[c], a, b);
    }
  }
  for (int c = 1; c < kChains; ++c) acc[0] = vaddq_s32(acc[0], acc[c]);
  return vaddvq_s32(acc[0]);
}
#elif QS_ARM_NEON
// neon.h without dotprod: smull / smull2 (s8 x s8 into int16) and sadalp (int16 pairs added into int32)
constexpr const char* kName = "smull+smull2+sadalp (NEON, 128-bit)";
constexpr int kChains = 8;
constexpr int64_t kMacsPerStep = kChains * 16;
int64_t run_steps(int64_t steps) {
  int32x4_t acc[kChains];
  for (auto& a : acc) a = vdupq_n_s32(0);
  int8x16_t a = vdupq_n_s8(3), b = vdupq_n_s8(-2);
  for (int64_t i = 0; i < steps; ++i) {
    opaque(a);
    #pragma GCC unroll 16  // every accumulator in a register of its own
    for (int c = 0; c < kChains; ++c) {
      opaque(b);
      acc[c] = vpadalq_s16(acc[c], vmull_s8(vget_low_s8(a), vget_low_s8(b)));
      acc[c] = vpadalq_s16(acc[c], vmull_high_s8(a, b));
    }
  }
  for (int c = 1; c < kChains; ++c) acc[0] = vaddq_s32(acc[0], acc[c]);
  return vaddvq_s32(acc[0]);
}
#else
// ggml/quants_ref.cpp: the scalar reference's int8 dot products, blocks of 32 codes summed in int32; the operands
// live in memory, which the compiler must reload every step (it may vectorize the loop, as it does the reference)
constexpr const char* kName = "C++ int8 dot loop (scalar reference)";
constexpr int kChains = 8;
constexpr int64_t kMacsPerStep = kChains * 32;
int64_t run_steps(int64_t steps) {
  int8_t a[kChains * 32], b[32];
  for (int k = 0; k < kChains * 32; ++k) a[k] = static_cast<int8_t>(k % 7 - 3);
  for (int k = 0; k < 32; ++k) b[k] = static_cast<int8_t>(k % 5 - 2);
  uint32_t acc[kChains] = {};  // unsigned: the sums wrap around without undefined behaviour
  for (int64_t i = 0; i < steps; ++i) {
    asm volatile("" : : "r"(a), "r"(b) : "memory");
    #pragma GCC unroll 16  // every accumulator in a register of its own
    for (int c = 0; c < kChains; ++c) {
      int32_t s = 0;
      for (int k = 0; k < 32; ++k) s += a[32 * c + k] * b[k];
      acc[c] += static_cast<uint32_t>(s);
    }
  }
  int64_t sum = 0;
  for (uint32_t v : acc) sum += v;
  return sum;
}
#endif

#if QS_X86_AMX_BUILD
// amx_tiles.h's tile multiplies: two A tiles (16 rows x 64 codes) against two B tiles (16 quads x 16 columns), into
// four C tiles, tdpbsud and tdpbssd as the kernel issues them: 16 x 16 x 64 products each
constexpr const char* kAmxName = "tdpbsud+tdpbssd (AMX int8)";
constexpr int64_t kAmxMacsPerStep = 4 * 16 * 16 * 64;
QS_AMX_TARGET int64_t run_amx_steps(int64_t steps) {
  ggml::x86::load_tile_config(ggml::x86::tile_config());
  alignas(64) int8_t operand[16 * 64];
  for (int k = 0; k < 16 * 64; ++k) operand[k] = static_cast<int8_t>(k % 7 - 3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < steps; ++i) {
    _tile_dpbsud(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbsud(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  alignas(64) int32_t c[4][16][16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  ggml::x86::release_tiles();
  int64_t sum = 0;
  for (int t = 0; t < 4; ++t) sum += c[t][0][0] + c[t][15][15];
  return sum;
}
#endif

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The stores of the loops' sums: they keep every accumulator live
volatile int64_t sink;

// GOP/s (2 ops per MAC) on one thread, and with `threads` threads each running the same loop at once
std::tuple<double, double> measure(int64_t (*run)(int64_t), int64_t macs_per_step, int64_t threads, double seconds) {
  // as many steps as take about half of `seconds` on one thread, found by doubling from a count that takes well
  // under a millisecond
  int64_t steps = 1024;
  double took;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    sink = run(steps);
    took = seconds_since(start);
    if (took >= seconds / 20) break;
    steps *= 2;
  }
  steps = std::max<int64_t>(steps, static_cast<int64_t>(static_cast<double>(steps) * (seconds / 2) / took));
  auto start = std::chrono::steady_clock::now();
  sink = run(steps);
  const double one = seconds_since(start);
  // one work item per thread (grain 1): at::parallel_for hands each thread its own item when there are as many as
  // it has threads, and serves more items in turns, which the wall time then counts
  std::vector<int64_t> sums(static_cast<size_t>(threads));
  start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) sums[static_cast<size_t>(t)] = run(steps);
  });
  const double all = seconds_since(start);
  int64_t total = 0;
  for (int64_t s : sums) total += s;
  sink = total;
  const double ops = 2.0 * static_cast<double>(steps) * static_cast<double>(macs_per_step);
  return {ops / one / 1e9, ops * static_cast<double>(threads) / all / 1e9};
}

}  // namespace

std::tuple<double, double, std::string> int8_roof(int64_t threads, double seconds, bool amx) {
  TORCH_CHECK(threads >= 0, "int8_roof: threads must be 0 (all of torch's threads) or more, got ", threads);
  TORCH_CHECK(seconds > 0 && seconds <= 60, "int8_roof: seconds must be in (0, 60], got ", seconds);
  const int64_t n = threads > 0 ? threads : at::get_num_threads();
  if (amx) {
#if QS_X86_AMX_BUILD
    TORCH_CHECK(ggml::x86::amx_int8_available(), "int8_roof: this CPU or OS does not allow AMX int8 tiles");
    const auto [one, all] = measure(run_amx_steps, kAmxMacsPerStep, n, seconds);
    return {one, all, kAmxName};
#else
    TORCH_CHECK(false, "int8_roof: this build has no AMX kernels");
#endif
  }
  const auto [one, all] = measure(run_steps, kMacsPerStep, n, seconds);
  return {one, all, kName};
}

}  // namespace qwenserve::cpu

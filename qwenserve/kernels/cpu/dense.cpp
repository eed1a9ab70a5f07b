// Linear layers on float weights narrower than the arithmetic: 2-byte bf16 / fp16 (for CPUs without arithmetic in
// those types) and 1-byte FP8 e4m3 codes with float32 scales (FP8 checkpoints; no CPU we build for multiplies FP8).
// Each weight is widened to float32 in registers inside the dot product, so the weights stay 2 or 1 bytes in memory
// and a decode step streams them once. PyTorch's own bf16 matmul on CPUs without bf16 converts through temporaries
// and runs several times slower than the weights' bytes allow, and it has no FP8 matmul on the CPU at all. For a
// few activation rows (decode, batched decode, speculative verify) this is the whole matmul; for many rows
// (prefill) the caller widens slices of the weight (fp8_dequantize for FP8) and runs float32 or bf16 matmuls
// instead (model/layers/linear.py, quantization/fp8.py), which one-row-at-a-time dot products cannot match, except
// for FP8 codes against bf16 activations on AVX512-BF16, which fp8_mm runs on register tiles of its own from 32 rows
// (fp8_mm_tiles below; fp8_tiles() says whether this build has them). On AVX512-BF16 builds bf16 weights against
// bf16 activations skip the widening: the pair dot products take both as they are (a tied LM head kept beside
// oneDNN's packed copy runs its decode rows here).
//
// dense_mm(out [M, N], x [M, K], w [N, K], bias [N] or None): out = x w^T + bias, summed in float32 and rounded once
// to out's dtype. x and out share a dtype (float32, bf16 or fp16); out may be a column slice of a wider tensor.
// fp8_mm(out, x, codes [N, K] uint8 e4m3, scales [N, ceil(K / group)] float32, group, bias): the same with
// w[n, k] = code[n, k] * scales[n, k / group] (block-wise checkpoints: group 128; per channel or tensor: group K).
// Work is split over weight rows in chunks that threads take as they finish (a shared host slows one core at times);
// each weight row is read as one stream against up to four activation rows at a time (from five rows, two weight rows
// at a time, which halves the activation loads per multiply-add), in eight independent float32 accumulator chains
// where the rows allow (the FMA latency covered). FP8 sums each scale group in the chains and adds it times its
// scale to a running total.
//
// e4m3 -> float in registers: the code's bits placed in an fp16's (sign to sign; exponent and mantissa to the low
// four exponent bits and the top of the mantissa) read as code * 2^-8 exactly, subnormal codes included, and F16C
// widens that to float32; the 2^8 rides in the group's scale. (The NaN codes 0x7f / 0xff read as 480; no
// checkpoint holds them.) Going through fp16 keeps float32 subnormals out of the arithmetic, which cost Intel cores a
// microcode assist each.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <vector>

#include "cpu_features.h"
#include "ops.h"
#include "vec.h"

#if QS_X86_AVX512_BF16
#include "arch/x86/dequantize.h"  // store16: bf16 rounding as from_float
#endif

#if QS_X86_AVX2
#include <immintrin.h>
#endif

namespace qwenserve::cpu {
namespace {

constexpr int kActivationRows = 4;  // activation rows per pass over a weight row: each widened vector serves all

// An FP8 e4m3 code (float8_e4m3fn's bits), as the dot products' weight type
struct E4M3 {
  uint8_t bits;
};
constexpr float kE4M3Unbias = 256.0f;  // what widening through fp16 leaves out of each code (2^8)

// Every code's value times 2^-8, as widening through fp16 gives it (the portable path's conversion)
const float* e4m3_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0xF, m = b & 7;
      const float v = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      t[b] = (b & 0x80 ? -v : v) / kE4M3Unbias;
    }
    return t;
  }();
  return table.data();
}

// A weight as float; FP8 codes without their 2^8 (their scales carry it)
inline float widen1(c10::BFloat16 w) { return static_cast<float>(w); }
inline float widen1(c10::Half w) { return static_cast<float>(w); }
inline float widen1(E4M3 w) { return e4m3_table()[w.bits]; }

#if QS_X86_AVX2
// 8 weights at p as float32
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 widen8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// e4m3 codes as 16-bit words holding the code in their high byte (word = b << 8) -> fp16 bits of code * 2^-8: the
// arithmetic shift right moves exponent and mantissa one bit lower with the sign copied into bit 14, which the mask
// clears
inline __m128i e4m3_halves(__m128i words) {
  return _mm_and_si128(_mm_srai_epi16(words, 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
}
inline __m256i e4m3_halves(__m256i words) {
  return _mm256_and_si256(_mm256_srai_epi16(words, 1), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}
inline __m256 widen8(const E4M3* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(e4m3_halves(_mm_unpacklo_epi8(_mm_setzero_si128(), bytes)));
}
// 32 codes at p as four vectors of 8 floats, in order. The byte-to-word unpacks work within each 128-bit half:
// the low words hold codes 0-7 and 16-23, the high ones 8-15 and 24-31. A third faster per code than
// widen8 (fewer instructions for each code), where the registers allow four vectors per weight row.
inline void widen32(const E4M3* p, __m256* v) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), zero = _mm256_setzero_si256();
  const __m256i low = e4m3_halves(_mm256_unpacklo_epi8(zero, bytes));
  const __m256i high = e4m3_halves(_mm256_unpackhi_epi8(zero, bytes));
  v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(low));
  v[1] = _mm256_cvtph_ps(_mm256_castsi256_si128(high));
  v[2] = _mm256_cvtph_ps(_mm256_extracti128_si256(low, 1));
  v[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(high, 1));
}

// Vectors one widening gives: four for FP8 where the accumulator chains take them (one or two dot products at a
// time), else one
template <typename W, int pairs>
constexpr int kWidenVectors = std::is_same_v<W, E4M3> && 8 / pairs >= 4 ? 4 : 1;
template <typename W, int V>
inline void widen(const W* p, __m256* v) {
  if constexpr (V == 4)
    widen32(p, v);
  else
    v[0] = widen8(p);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// res[r][i] = weight row i . activation row r, for NR weight rows (w, ldw apart) and R activation rows (x, ldx
// apart, float32); with scales (FP8), weight row i's columns [g * group, (g + 1) * group) are multiplied by
// scales[i * lds + g] (times 2^8, see kE4M3Unbias). Eight accumulator chains for NR x R = 1, 2, 4 or 8 (six for 3):
// each pair takes 8 / (NR x R) of them, for vectors k, k + 8, ... in turn (FP8 codes widened 32 at a time where a
// pair has four or more chains); the remaining multiples of 8 go to the first chain, a group's tail (K % 8 without groups) to scalar code. Lines a weight row will read kAheadBytes later
// are prefetched: a row read as one stream, which the hardware prefetchers alone leave at about two thirds of the
// read bandwidth.
template <typename W, int NR, int R>
void dot_rows(const W* w, int64_t ldw, const float* scales, int64_t lds, int64_t group, const float* x, int64_t ldx,
              int64_t K, float (*res)[NR]) {
  constexpr int kSplit = std::max(1, 8 / (NR * R));
  constexpr int64_t kStep = 8 * kSplit, kAheadBytes = 1024;
  __m256 acc[R][NR][kSplit], total[R][NR];
  float tail[R][NR];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) total[r][i] = _mm256_setzero_ps(), tail[r][i] = 0;
  // V vectors of weights at k into chains s .. s + V - 1
  const auto step = [&](int64_t k, int s, auto vectors) {
    constexpr int V = vectors();
    for (int i = 0; i < NR; ++i) {
      __m256 wv[V];
      widen<W, V>(w + i * ldw + k, wv);
      for (int j = 0; j < V; ++j)
        for (int r = 0; r < R; ++r)
          acc[r][i][s + j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + r * ldx + k + 8 * j), acc[r][i][s + j]);
    }
  };
  constexpr int kVectors = kWidenVectors<W, NR * R>;
  static_assert(kSplit % kVectors == 0, "each widening's vectors take whole chains");
  if (scales == nullptr) group = K;
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
    const int64_t g1 = std::min(K, g0 + group);
    for (auto& a : acc)
      for (auto& b : a)
        for (auto& c : b) c = _mm256_setzero_ps();
    int64_t k = g0;
    for (; k + kStep <= g1; k += kStep) {
      if (kStep * sizeof(W) >= 64 || (k * sizeof(W)) % 64 == 0)  // once per line of each row
        for (int i = 0; i < NR; ++i)
          for (int64_t b = 0; b < kStep * static_cast<int64_t>(sizeof(W)); b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(w + i * ldw + k) + kAheadBytes + b, _MM_HINT_T0);
      for (int s = 0; s < kSplit; s += kVectors) step(k + 8 * s, s, std::integral_constant<int, kVectors>{});
    }
    for (; k + 8 <= g1; k += 8) step(k, 0, std::integral_constant<int, 1>{});
    for (int i = 0; i < NR; ++i) {
      const float scale = scales ? scales[i * lds + g] * kE4M3Unbias : 1.0f;
      for (int r = 0; r < R; ++r) {
        __m256 a = acc[r][i][0];
        for (int s = 1; s < kSplit; ++s) a = _mm256_add_ps(a, acc[r][i][s]);
        float rest = 0;
        for (int64_t j = k; j < g1; ++j) rest += widen1(w[i * ldw + j]) * x[r * ldx + j];
        total[r][i] = scales ? _mm256_fmadd_ps(a, _mm256_set1_ps(scale), total[r][i]) : _mm256_add_ps(a, total[r][i]);
        tail[r][i] += rest * scale;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) res[r][i] = hsum8(total[r][i]) + tail[r][i];
}
#else
// the portable build: plain loops the compiler vectorises where it can
template <typename W, int NR, int R>
void dot_rows(const W* w, int64_t ldw, const float* scales, int64_t lds, int64_t group, const float* x, int64_t ldx,
              int64_t K, float (*res)[NR]) {
  if (scales == nullptr) group = K;
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) {
      float sum = 0;
      for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
        const int64_t g1 = std::min(K, g0 + group);
        float lanes[kLanes] = {0};
        int64_t k = g0;
        for (; k + kLanes <= g1; k += kLanes)
          for (int j = 0; j < kLanes; ++j) lanes[j] += widen1(w[i * ldw + k + j]) * x[r * ldx + k + j];
        float part = 0;
        for (int j = 0; j < kLanes; ++j) part += lanes[j];
        for (; k < g1; ++k) part += widen1(w[i * ldw + k]) * x[r * ldx + k];
        sum += scales ? part * (scales[i * lds + g] * kE4M3Unbias) : part;
      }
      res[r][i] = sum;
    }
}
#endif

#if QS_X86_AVX512_BF16
// FP8 codes against bf16 activations on AVX512-BF16's pair dot products (vdpbf16ps: 32 products a vector), about
// twice the codes a core widens per second on the float path: codes become bf16 by bit operations, and the
// activations, exact in bf16 already, are copied once per call into the order those operations leave the codes in.
// A code's bits placed in a bf16's (sign to sign; exponent and mantissa to the low bits of its exponent and the top
// of its mantissa) read as code * 2^-120; the activations are lifted by 2^64 (exact), so the products, code * x *
// 2^-56, stay far from float32's subnormals, which the instruction reads and writes as zero; the scales carry the
// 2^56 back. Subnormal codes (|code| < 2^-6, below 1 / 28672 of a block's largest weight) read as zero here: the
// one difference from the dequantized weights, and far below bf16's rounding of the outputs.
constexpr int kPairBlock = 64;      // codes per 512-bit load
constexpr float kXLift = 0x1p64f;   // the activations' lift
constexpr float kPairUnbias = 0x1p56f;  // what the scales carry: 2^120 / 2^64
constexpr float kLiftLimit = 0x1p60f;   // activations at or past this take the float path (the lift would overflow)

// x row's bf16 bits lifted by 2^64 and, per 64 columns, in the order e4m3_pairs leaves codes: the 16-bit unpacks
// work within 128-bit lanes, so the low vector holds columns 0-7, 16-23, 32-39, 48-55 and the high one the rest
inline void lift_and_order(uint16_t* dst, const c10::BFloat16* src, int64_t K) {
  for (int64_t k = 0; k < K; k += kPairBlock)
    for (int lane = 0; lane < 4; ++lane)
      for (int half = 0; half < 2; ++half)
        for (int j = 0; j < 8; ++j) {
          const float v = static_cast<float>(src[k + 16 * lane + 8 * half + j]) * kXLift;
          dst[k + 32 * half + 8 * lane + j] = c10::BFloat16(v).x;
        }
}

inline void e4m3_pairs(const uint8_t* p, __m512i& low, __m512i& high) {
  // b << 8 in each word (the unpack), then shifted right by four with the sign copied into bits 14-11, which the
  // mask clears: sign, then exponent and mantissa at bits 10-4
  const __m512i bytes = _mm512_loadu_si512(p), zero = _mm512_setzero_si512();
  const __m512i mask = _mm512_set1_epi16(static_cast<short>(0x87FF));
  low = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpacklo_epi8(zero, bytes), 4), mask);
  high = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpackhi_epi8(zero, bytes), 4), mask);
}

// dot_rows' contract on codes (w, uint8) and lifted, ordered activations (x, bf16 bits); group and K multiples of
// 64. Chains: two per 64 codes (their low and high vectors), four or more per pair of rows, so the instruction's
// latency is covered.
template <int NR, int R>
void dot_rows_pairs(const uint8_t* w, int64_t ldw, const float* scales, int64_t lds, int64_t group, const uint16_t* x,
                    int64_t ldx, int64_t K, float (*res)[NR]) {
  constexpr int kBlocks = std::max(1, 4 / (NR * R));  // 64-code blocks per step of each row
  constexpr int64_t kAheadBytes = 1024;
  __m512 acc[R][NR][2 * kBlocks], total[R][NR];
  for (auto& a : total)
    for (auto& t : a) t = _mm512_setzero_ps();
  const auto block = [&](int64_t k, int c) {
    for (int i = 0; i < NR; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w + i * ldw + k) + kAheadBytes, _MM_HINT_T0);
      __m512i low, high;
      e4m3_pairs(w + i * ldw + k, low, high);
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * ldx + k;
        acc[r][i][2 * c] = _mm512_dpbf16_ps(acc[r][i][2 * c], (__m512bh)low, (__m512bh)_mm512_loadu_si512(xr));
        acc[r][i][2 * c + 1] =
            _mm512_dpbf16_ps(acc[r][i][2 * c + 1], (__m512bh)high, (__m512bh)_mm512_loadu_si512(xr + 32));
      }
    }
  };
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
    const int64_t g1 = std::min(K, g0 + group);
    for (auto& a : acc)
      for (auto& b : a)
        for (auto& c : b) c = _mm512_setzero_ps();
    int64_t k = g0;
    for (; k + kBlocks * kPairBlock <= g1; k += kBlocks * kPairBlock)
      for (int c = 0; c < kBlocks; ++c) block(k + c * kPairBlock, c);
    for (; k < g1; k += kPairBlock) block(k, 0);
    for (int i = 0; i < NR; ++i) {
      const __m512 scale = _mm512_set1_ps(scales[i * lds + g] * kPairUnbias);
      for (int r = 0; r < R; ++r) {
        __m512 a = acc[r][i][0];
        for (int c = 1; c < 2 * kBlocks; ++c) a = _mm512_add_ps(a, acc[r][i][c]);
        total[r][i] = _mm512_fmadd_ps(a, scale, total[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) res[r][i] = _mm512_reduce_add_ps(total[r][i]);
}

// dot_rows' contract on bf16 weights and bf16 activations (both as bits), any K: each 32-weight vector meets the
// R activation rows' vectors in the pair dot products, with no widening (the float path widens every weight), so a
// few activation rows cost about one row's time. Eight chains or more (two per pair of rows) cover the instruction's
// latency. The last K % 32 columns read through a mask.
template <int NR, int R>
void dot_rows_bf16(const uint16_t* w, int64_t ldw, const uint16_t* x, int64_t ldx, int64_t K, float (*res)[NR]) {
  constexpr int kChains = std::max(2, 8 / (NR * R));
  constexpr int64_t kAheadBytes = 1024;
  __m512 acc[R][NR][kChains];
  for (auto& a : acc)
    for (auto& b : a)
      for (auto& c : b) c = _mm512_setzero_ps();
  const auto step = [&](int64_t k, int c, __mmask32 mask) {
    for (int i = 0; i < NR; ++i) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + i * ldw + k);
      for (int r = 0; r < R; ++r)
        acc[r][i][c] = _mm512_dpbf16_ps(acc[r][i][c], (__m512bh)wv,
                                        (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * ldx + k));
    }
  };
  int64_t k = 0;
  for (; k + 32 * kChains <= K; k += 32 * kChains) {
    for (int i = 0; i < NR; ++i)
      for (int64_t b = 0; b < 64 * kChains; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + i * ldw + k) + kAheadBytes + b, _MM_HINT_T0);
    for (int c = 0; c < kChains; ++c) step(k + 32 * c, c, ~__mmask32{0});
  }
  for (; k < K; k += 32) step(k, 0, K - k >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (K - k)) - 1));
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) {
      __m512 a = acc[r][i][0];
      for (int c = 1; c < kChains; ++c) a = _mm512_add_ps(a, acc[r][i][c]);
      res[r][i] = _mm512_reduce_add_ps(a);
    }
}
#endif

// f(std::integral_constant<int, r>) for r = 1 .. Max: the dot products and tiles keep a compile-time row count
template <int Max = kActivationRows, typename F>
inline void with_rows(int r, F f) {
  if constexpr (Max > 1)
    if (r < Max) return with_rows<Max - 1>(r, f);
  f(std::integral_constant<int, Max>{});
}

// The weights of one matmul: rows of K weights; for FP8, a float32 scale per row and group of input columns
struct WeightRows {
  const void* data;
  const float* scales = nullptr;  // [N, lds]
  int64_t lds = 0;
  int64_t group = 0;
};

// out[m, n] = dot(weight row n, activation row m) + bias[n] for every m < M, n < N, rounded once to T. Weight rows
// are split in chunks that threads take as they finish (a shared host slows one core at times); each weight row
// meets up to four activation rows at a time, from five rows two weight rows at a time. dot(NR, R, n, m, res)
// fills res[r][i] for weight rows n + i and activation rows m + r (NR and R as integral constants).
template <typename T, typename Dot>
void for_each_tile(at::Tensor& out, int64_t M, int64_t N, const float* bias, Dot dot) {
  T* op = out.data_ptr<T>();
  const int64_t ldo = out.stride(0);
  auto store = [&](int64_t m, int64_t n, float v) { op[m * ldo + n] = from_float<T>(bias ? v + bias[n] : v); };
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, N / (threads * 8));
  const int64_t chunks = (N + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;)
      for (int64_t n = c * chunk, n1 = std::min(N, n + chunk); n < n1;) {
        if (M > kActivationRows && n + 1 < n1) {  // two weight rows against four activation rows at a time
          for (int64_t m = 0; m < M; m += kActivationRows) {
            float res[kActivationRows][2];
            const int rows = static_cast<int>(std::min<int64_t>(kActivationRows, M - m));
            with_rows(rows, [&](auto r) { dot(std::integral_constant<int, 2>{}, r, n, m, res); });
            for (int r = 0; r < rows; ++r) store(m + r, n, res[r][0]), store(m + r, n + 1, res[r][1]);
          }
          n += 2;
          continue;
        }
        for (int64_t m = 0; m < M; m += kActivationRows) {  // the row stays in L1 for the later passes
          float res[kActivationRows][1];
          const int rows = static_cast<int>(std::min<int64_t>(kActivationRows, M - m));
          with_rows(rows, [&](auto r) { dot(std::integral_constant<int, 1>{}, r, n, m, res); });
          for (int r = 0; r < rows; ++r) store(m + r, n, res[r][0]);
        }
        n += 1;
      }
  });
}

template <typename T, typename W>
void dense_mm_impl(at::Tensor& out, const at::Tensor& x, const WeightRows& weights, int64_t N, const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), lds = weights.lds, group = weights.group;
  const W* wp = static_cast<const W*>(weights.data);
  const float* sp = weights.scales;
  // the activations in float32, once: every weight row meets them
  std::vector<float> widened;
  const float* xf;
  int64_t ldx = K;
  if constexpr (std::is_same_v<T, float>) {
    xf = x.data_ptr<float>();
    ldx = x.stride(0);
  } else {
    widened.resize(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m) load_float(widened.data() + m * K, x.data_ptr<T>() + m * x.stride(0), K);
    xf = widened.data();
  }
  for_each_tile<T>(out, M, N, bias, [&](auto nr, auto r, int64_t n, int64_t m, auto res) {
    dot_rows<W, nr(), r()>(wp + n * K, K, sp ? sp + n * lds : nullptr, lds, group, xf + m * ldx, ldx, K, res);
  });
}

#if QS_X86_AVX512_BF16
// dense_mm of bf16 weights against bf16 activations on the pair dot products
void dense_mm_bf16_pairs(at::Tensor& out, const at::Tensor& x, const uint16_t* w, int64_t N, const float* bias) {
  const int64_t K = x.size(1), ldx = x.stride(0);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  for_each_tile<c10::BFloat16>(out, x.size(0), N, bias, [&](auto nr, auto r, int64_t n, int64_t m, auto res) {
    dot_rows_bf16<nr(), r()>(w + n * K, K, xp + m * ldx, ldx, K, res);
  });
}
#endif

template <typename W>
void dense_mm_dispatch(at::Tensor& out, const at::Tensor& x, const WeightRows& weights, int64_t N, const float* bias) {
  AT_DISPATCH_SWITCH(x.scalar_type(), "dense_mm",
                     AT_DISPATCH_CASE(at::kFloat, [&] { dense_mm_impl<scalar_t, W>(out, x, weights, N, bias); })
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { dense_mm_impl<scalar_t, W>(out, x, weights, N, bias); })
                     AT_DISPATCH_CASE(at::kHalf, [&] { dense_mm_impl<scalar_t, W>(out, x, weights, N, bias); }));
}

// The checks both matmuls share; bias as float32 (undefined without one)
at::Tensor check_matmul(const char* op, const at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, op, " takes 2-D out, x and w");
  TORCH_CHECK(w.size(1) == x.size(1), op, ": w has ", w.size(1), " columns, x has ", x.size(1));
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.size(0), op, ": out must be [", x.size(0), ", ",
              w.size(0), "], got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), op, ": out and x must share a dtype");
  TORCH_CHECK(w.is_contiguous(), op, ": w must be contiguous");
  check_cpu_contiguous_rows(x, "x");
  check_cpu_contiguous_rows(out, "out");
  TORCH_CHECK(w.device().is_cpu(), "w must be on the CPU");
  if (!bias.has_value()) return {};
  TORCH_CHECK(bias->numel() == w.size(0), op, ": bias has ", bias->numel(), " values for ", w.size(0), " rows");
  return bias->to(at::kFloat).contiguous();
}

// The checks of FP8 scales [N, ceil(K / group)] float32
void check_fp8_scales(const at::Tensor& codes, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(codes.scalar_type() == at::kByte || codes.scalar_type() == at::kFloat8_e4m3fn,
              "FP8 codes must be uint8 or float8_e4m3fn, not ", codes.scalar_type());
  TORCH_CHECK(group > 0, "FP8 scale group must be positive, got ", group);
  const int64_t groups = (codes.size(1) + group - 1) / group;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == codes.size(0) &&
                  scales.size(1) == groups && scales.is_contiguous() && scales.device().is_cpu(),
              "FP8 scales must be contiguous float32 [", codes.size(0), ", ", groups, "] on the CPU, got ",
              scales.scalar_type(), " ", scales.sizes());
}

// Each row widened into float32 (vectors of codes times the group's scale), then rounded to T
template <typename T>
void fp8_dequantize_impl(at::Tensor& out, const uint8_t* codes, const float* scales, int64_t N, int64_t K,
                         int64_t lds, int64_t group) {
  T* op = out.data_ptr<T>();
  const int64_t ldo = out.stride(0);
  const float* table = e4m3_table();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(std::is_same_v<T, float> ? 0 : K);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* c = codes + n * K;
      float* o = std::is_same_v<T, float> ? reinterpret_cast<float*>(op + n * ldo) : row.data();
      for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
        const int64_t g1 = std::min(K, g0 + group);
        const float scale = scales[n * lds + g] * kE4M3Unbias;
        int64_t k = g0;
#if QS_X86_AVX2
        const __m256 sv = _mm256_set1_ps(scale);
        for (; k + 32 <= g1; k += 32) {
          __m256 v[4];
          widen32(reinterpret_cast<const E4M3*>(c + k), v);
          for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + k + 8 * j, _mm256_mul_ps(v[j], sv));
        }
        for (; k + 8 <= g1; k += 8)
          _mm256_storeu_ps(o + k, _mm256_mul_ps(widen8(reinterpret_cast<const E4M3*>(c + k)), sv));
#endif
        for (; k < g1; ++k) o[k] = table[c[k]] * scale;
      }
      if constexpr (!std::is_same_v<T, float>)
        for (int64_t k = 0; k < K; ++k) op[n * ldo + k] = from_float<T>(row[k]);
    }
  });
}

#if QS_X86_AVX512_BF16
// fp8_mm on the pair dot products where they apply: bf16 activations, scale groups and rows in whole 64-code
// blocks, activations below kLiftLimit. False: the caller takes the float path.
bool fp8_mm_bf16_pairs(at::Tensor& out, const at::Tensor& x, const WeightRows& weights, int64_t N, const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), lds = weights.lds, group = weights.group;
  if (x.scalar_type() != at::kBFloat16 || K % kPairBlock != 0 || group % kPairBlock != 0) return false;
  std::vector<uint16_t> lifted(static_cast<size_t>(M * K));
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* row = x.data_ptr<c10::BFloat16>() + m * x.stride(0);
    for (int64_t k = 0; k < K; ++k)
      if (!(std::abs(static_cast<float>(row[k])) < kLiftLimit)) return false;  // NaN included
    lift_and_order(lifted.data() + m * K, row, K);
  }
  const auto* wp = static_cast<const uint8_t*>(weights.data);
  for_each_tile<c10::BFloat16>(out, M, N, bias, [&](auto nr, auto r, int64_t n, int64_t m, auto res) {
    dot_rows_pairs<nr(), r()>(wp + n * K, K, weights.scales + n * lds, lds, group, lifted.data() + m * K, K, K, res);
  });
  return true;
}

// Many activation rows (prefill) of FP8 codes against bf16 activations: register tiles of kTileRows activation rows
// x kPanelCols weight rows on the same pair dot products, so each widened code serves every activation row and each
// loaded activation pair 32 products. A thread takes a panel of 32 weight rows at a time, widens its codes once into
// bf16 pairs laid out for the tiles (pair q of the 32 rows side by side: two vectors whose lane j is row j's codes
// 2q, 2q + 1), then runs all activation rows against it. Lanes are weight rows, so a scale group's sums are scaled by
// one vector of the 32 rows' scales. The arithmetic is fp8_mm_bf16_pairs' (codes * 2^-120, activations * 2^64).
constexpr int kPanelCols = 32;
constexpr int kTileRows = 12;  // 24 accumulators, two weight vectors and a broadcast: the 32 registers, nearly
constexpr int64_t kPairTilesFromRows = 32;  // below, the pair dot products measure faster (their four-row passes)

inline uint32_t e4m3_bf16_bits(uint8_t b) { return (b & 0x80u) << 8 | (b & 0x7Fu) << 4; }

// The 32 codes at p as 16 lanes of bf16 pairs (lane q: codes 2q, 2q + 1)
inline __m512i e4m3_pair_lanes(const uint8_t* p) {
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(words, 8), 4),
                          _mm512_set1_epi16(static_cast<short>(0x87FF)));
}

// r[i] lane j -> r[j] lane i, 32-bit lanes
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + e], 128-bit lane L: rows 4i .. 4i + 3 at column 4L + e
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), x1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Weight rows n0 .. n0 + cols - 1 (cols <= 32; the panel's other lanes zero) as panel[q * 32 + j] = bf16 pair q of
// row n0 + j, and their scales as group_scales[g * 32 + j] (times 2^56, see kPairUnbias)
void pack_panel(const WeightRows& weights, int64_t K, int64_t n0, int64_t cols, uint32_t* panel, float* group_scales) {
  const auto* codes = static_cast<const uint8_t*>(weights.data) + n0 * K;
  const int64_t groups = (K + weights.group - 1) / weights.group;
  for (int half = 0; half < 2; ++half) {
    const int64_t first = 16 * half, rows = std::clamp<int64_t>(cols - first, 0, 16);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = j < rows ? e4m3_pair_lanes(codes + (first + j) * K + k) : _mm512_setzero_si512();
      transpose16(r);
      for (int q = 0; q < 16; ++q) _mm512_storeu_si512(panel + (k / 2 + q) * kPanelCols + first, r[q]);
    }
    for (; k < K; k += 2)
      for (int j = 0; j < 16; ++j) {
        const uint8_t* c = codes + (first + j) * K + k;
        panel[k / 2 * kPanelCols + first + j] = j < rows ? e4m3_bf16_bits(c[0]) | e4m3_bf16_bits(c[1]) << 16 : 0;
      }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int j = 0; j < kPanelCols; ++j)
      group_scales[g * kPanelCols + j] = j < cols ? weights.scales[(n0 + j) * weights.lds + g] * kPairUnbias : 0.0f;
}

// total[r * 32 + j] = activation row r . panel row j for R activation rows (x: bf16 pairs, ldx pairs apart), summed
// per scale group of group_pairs pairs, each group's sums times its scales
template <int R>
void panel_tile(const uint32_t* panel, const float* group_scales, const uint32_t* x, int64_t ldx, int64_t pairs,
                int64_t group_pairs, float* total) {
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(total + r * kPanelCols + 16 * h, _mm512_setzero_ps());
  for (int64_t g0 = 0, g = 0; g0 < pairs; g0 += group_pairs, ++g) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t q = g0, q1 = std::min(pairs, g0 + group_pairs); q < q1; ++q) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + q * kPanelCols);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + q * kPanelCols + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + q]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, a);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, a);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = _mm512_loadu_ps(group_scales + g * kPanelCols + 16 * h);
      for (int r = 0; r < R; ++r) {
        float* t = total + r * kPanelCols + 16 * h;
        _mm512_storeu_ps(t, _mm512_fmadd_ps(acc[r][h], scale, _mm512_loadu_ps(t)));
      }
    }
  }
}

// dst[j] = v[j] (+ bias[j]) rounded to bf16 as from_float rounds, j < cols (<= 32)
inline void store_panel_row(c10::BFloat16* dst, const float* v, const float* bias, int64_t cols) {
  for (int h = 0; h < 2 && cols > 16 * h; ++h) {
    __m512 f = _mm512_loadu_ps(v + 16 * h);
    if (bias) f = _mm512_add_ps(f, _mm512_loadu_ps(bias + 16 * h));
    const int64_t n = std::min<int64_t>(16, cols - 16 * h);
    if (n == 16) {
      ggml::x86::store16(dst + 16 * h, f);
    } else {
      c10::BFloat16 rounded[16];
      ggml::x86::store16(rounded, f);
      std::copy(rounded, rounded + n, dst + 16 * h);
    }
  }
}

// x's bf16 rows lifted by 2^64 into dst [M, K] (bf16 bits); false where an activation is at or past kLiftLimit or NaN
bool lift_rows(const at::Tensor& x, uint16_t* dst) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  std::atomic<bool> fits{true};
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    const __m512 lift = _mm512_set1_ps(kXLift), limit = _mm512_set1_ps(kLiftLimit);
    __mmask16 ok = 0xFFFF;
    for (int64_t m = m0; m < m1; ++m) {
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + m * ldx + k));
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
        ok &= _mm512_cmp_ps_mask(_mm512_abs_ps(v), limit, _CMP_LT_OQ);  // false for NaN
        const __m512i lifted = _mm512_srli_epi32(_mm512_castps_si512(_mm512_mul_ps(v, lift)), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + m * K + k), _mm512_cvtepi32_epi16(lifted));
      }
      for (; k < K; ++k) {
        const float v = static_cast<float>(c10::BFloat16(src[m * ldx + k], c10::BFloat16::from_bits()));
        if (!(std::abs(v) < kLiftLimit)) ok = 0;
        dst[m * K + k] = c10::BFloat16(v * kXLift).x;  // exact: a power of two
      }
    }
    if (ok != 0xFFFF) fits = false;
  });
  return fits;
}

// fp8_mm on the tiles where they apply: bf16 activations, kPairTilesFromRows rows or more, K and the scale group
// even (whole pairs). False: the caller takes another path.
bool fp8_mm_tiles(at::Tensor& out, const at::Tensor& x, const WeightRows& weights, int64_t N, const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), group = weights.group;
  if (x.scalar_type() != at::kBFloat16 || M < kPairTilesFromRows || K % 2 != 0 || group % 2 != 0) return false;
  std::vector<uint16_t> lifted(static_cast<size_t>(M * K));
  if (!lift_rows(x, lifted.data())) return false;
  const auto* xp = reinterpret_cast<const uint32_t*>(lifted.data());
  const int64_t pairs = K / 2, groups = (K + group - 1) / group, panels = (N + kPanelCols - 1) / kPanelCols;
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldo = out.stride(0);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<uint32_t> panel(static_cast<size_t>(pairs * kPanelCols));
    std::vector<float> group_scales(static_cast<size_t>(groups * kPanelCols));
    alignas(64) float total[kTileRows * kPanelCols];
    for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < panels;) {
      const int64_t n0 = p * kPanelCols, cols = std::min<int64_t>(kPanelCols, N - n0);
      pack_panel(weights, K, n0, cols, panel.data(), group_scales.data());
      float bias_storage[kPanelCols];
      const float* bias_panel = nullptr;
      if (bias) {
        for (int j = 0; j < kPanelCols; ++j) bias_storage[j] = j < cols ? bias[n0 + j] : 0.0f;
        bias_panel = bias_storage;
      }
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m));
        with_rows<kTileRows>(rows, [&](auto r) {
          panel_tile<r()>(panel.data(), group_scales.data(), xp + m * pairs, pairs, pairs, group / 2, total);
        });
        for (int r = 0; r < rows; ++r)
          store_panel_row(op + (m + r) * ldo + n0, total + r * kPanelCols, bias_panel, cols);
      }
    }
  });
  return true;
}
#endif

}  // namespace

void dense_mm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const at::Tensor bias_f = check_matmul("dense_mm", out, x, w, bias);
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf,
              "dense_mm runs bf16 or fp16 weights, not ", w.scalar_type());
  const WeightRows weights{w.data_ptr()};
#if QS_X86_AVX512_BF16
  if (w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16) {
    dense_mm_bf16_pairs(out, x, static_cast<const uint16_t*>(w.data_ptr()), w.size(0), bp);
    return;
  }
#endif
  if (w.scalar_type() == at::kBFloat16)
    dense_mm_dispatch<c10::BFloat16>(out, x, weights, w.size(0), bp);
  else
    dense_mm_dispatch<c10::Half>(out, x, weights, w.size(0), bp);
}

void fp8_mm(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group,
            const std::optional<at::Tensor>& bias) {
  const at::Tensor bias_f = check_matmul("fp8_mm", out, x, codes, bias);
  check_fp8_scales(codes, scales, group);
  const WeightRows weights{codes.data_ptr(), scales.data_ptr<float>(), scales.size(1), group};
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
#if QS_X86_AVX512_BF16
  if (fp8_mm_tiles(out, x, weights, codes.size(0), bp) || fp8_mm_bf16_pairs(out, x, weights, codes.size(0), bp))
    return;
#endif
  dense_mm_dispatch<E4M3>(out, x, weights, codes.size(0), bp);
}

bool fp8_tiles() { return QS_X86_AVX512_BF16 != 0; }

void fp8_dequantize(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.device().is_cpu(),
              "fp8_dequantize: codes must be contiguous 2-D on the CPU");
  check_fp8_scales(codes, scales, group);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == codes.size(0) && out.size(1) == codes.size(1), "fp8_dequantize: out "
              "must be [", codes.size(0), ", ", codes.size(1), "], got ", out.sizes());
  check_cpu_contiguous_rows(out, "out");
  const auto* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  AT_DISPATCH_SWITCH(out.scalar_type(), "fp8_dequantize", AT_DISPATCH_CASE(at::kFloat, [&] {
                       fp8_dequantize_impl<scalar_t>(out, cp, sp, codes.size(0), codes.size(1), scales.size(1), group);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       fp8_dequantize_impl<scalar_t>(out, cp, sp, codes.size(0), codes.size(1), scales.size(1), group);
                     }) AT_DISPATCH_CASE(at::kHalf, [&] {
                       fp8_dequantize_impl<scalar_t>(out, cp, sp, codes.size(0), codes.size(1), scales.size(1), group);
                     }));
}

}  // namespace qwenserve::cpu

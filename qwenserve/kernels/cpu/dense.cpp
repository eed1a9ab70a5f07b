// Linear layers on 2-byte float weights (bf16, fp16) for CPUs without arithmetic in those types: each weight is
// widened to float32 in registers inside the dot product, so the weights stay 2 bytes in memory and a decode step
// streams them once. PyTorch's own bf16 matmul on such CPUs converts through temporaries and runs several times
// slower than the weights' bytes allow. For a few activation rows (decode, batched decode, speculative verify)
// this is the whole matmul; for many rows (prefill) the caller widens slices of the weight and runs float32
// matmuls instead (model/layers/linear.py), which this kernel's one-row-at-a-time dot products cannot match.
//
// dense_mm(out [M, N], x [M, K], w [N, K], bias [N] or None): out = x w^T + bias, summed in float32 and rounded once
// to out's dtype. x and out share a dtype (float32, bf16 or fp16); out may be a column slice of a wider tensor.
// Work is split over weight rows in chunks that threads take as they finish (a shared host slows one core at times);
// each weight row is read as one stream against up to four activation rows at a time (from five rows, two weight rows
// at a time, which halves the activation loads per multiply-add), in eight independent float32 accumulator chains
// where the rows allow (the FMA latency covered).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "cpu_features.h"
#include "ops.h"
#include "vec.h"

#if QS_X86_AVX2
#include <immintrin.h>
#endif

namespace qwenserve::cpu {
namespace {

constexpr int kActivationRows = 4;  // activation rows per pass over a weight row: each widened vector serves all

#if QS_X86_AVX2
// 8 weights at p as float32
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 widen8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// res[r][i] = weight row i . activation row r, for NR weight rows (w, ldw apart) and R activation rows (x, ldx
// apart, float32). Eight accumulator chains for NR x R = 1, 2, 4 or 8 (six for 3): each pair takes 8 / (NR x R) of
// them, for vectors k, k + 8, ... in turn; the remaining multiples of 8 go to the first chain, the K % 8 tail to
// scalar code. Lines a weight row will read kAheadBytes later are prefetched: a row read as one stream, which the
// hardware prefetchers alone leave at about two thirds of the read bandwidth.
template <typename W, int NR, int R>
void dot_rows(const W* w, int64_t ldw, const float* x, int64_t ldx, int64_t K, float (*res)[NR]) {
  constexpr int kSplit = std::max(1, 8 / (NR * R));
  constexpr int64_t kStep = 8 * kSplit, kAheadBytes = 1024;
  __m256 acc[R][NR][kSplit];
  for (auto& a : acc)
    for (auto& b : a)
      for (auto& c : b) c = _mm256_setzero_ps();
  const auto step = [&](int64_t k, int s) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
    for (int i = 0; i < NR; ++i) {
      const __m256 wv = widen8(w + i * ldw + k);
      for (int r = 0; r < R; ++r) acc[r][i][s] = _mm256_fmadd_ps(wv, xv[r], acc[r][i][s]);
    }
  };
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    if (kStep * sizeof(W) >= 64 || (k * sizeof(W)) % 64 == 0)  // once per line of each row
      for (int i = 0; i < NR; ++i)
        for (int64_t b = 0; b < kStep * static_cast<int64_t>(sizeof(W)); b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w + i * ldw + k) + kAheadBytes + b, _MM_HINT_T0);
    for (int s = 0; s < kSplit; ++s) step(k + 8 * s, s);
  }
  for (; k + 8 <= K; k += 8) step(k, 0);
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) {
      __m256 a = acc[r][i][0];
      for (int s = 1; s < kSplit; ++s) a = _mm256_add_ps(a, acc[r][i][s]);
      float sum = hsum8(a);
      for (int64_t j = k; j < K; ++j) sum += static_cast<float>(w[i * ldw + j]) * x[r * ldx + j];
      res[r][i] = sum;
    }
}
#else
// the portable build: plain loops the compiler vectorises where it can
template <typename W, int NR, int R>
void dot_rows(const W* w, int64_t ldw, const float* x, int64_t ldx, int64_t K, float (*res)[NR]) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) {
      float lanes[kLanes] = {0};
      int64_t k = 0;
      for (; k + kLanes <= K; k += kLanes)
        for (int j = 0; j < kLanes; ++j) lanes[j] += static_cast<float>(w[i * ldw + k + j]) * x[r * ldx + k + j];
      float sum = 0;
      for (int j = 0; j < kLanes; ++j) sum += lanes[j];
      for (; k < K; ++k) sum += static_cast<float>(w[i * ldw + k]) * x[r * ldx + k];
      res[r][i] = sum;
    }
}
#endif

// f(std::integral_constant<int, r>) for r = 1 .. kActivationRows: the dot products keep a compile-time row count
template <typename F>
inline void with_rows(int r, F f) {
  switch (r) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

template <typename T, typename W>
void dense_mm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldo = out.stride(0);
  const W* wp = w.data_ptr<W>();
  T* op = out.data_ptr<T>();
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
  auto store = [&](int64_t m, int64_t n, float v) { op[m * ldo + n] = from_float<T>(bias ? v + bias[n] : v); };
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, N / (threads * 8));
  const int64_t chunks = (N + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;)
      for (int64_t n = c * chunk, n1 = std::min(N, n + chunk); n < n1;) {
        const W* wn = wp + n * K;
        if (M > kActivationRows && n + 1 < n1) {  // two weight rows against four activation rows at a time
          for (int64_t m = 0; m < M; m += kActivationRows) {
            float res[kActivationRows][2];
            const int rows = static_cast<int>(std::min<int64_t>(kActivationRows, M - m));
            with_rows(rows, [&](auto r) { dot_rows<W, 2, r()>(wn, K, xf + m * ldx, ldx, K, res); });
            for (int r = 0; r < rows; ++r) store(m + r, n, res[r][0]), store(m + r, n + 1, res[r][1]);
          }
          n += 2;
          continue;
        }
        for (int64_t m = 0; m < M; m += kActivationRows) {  // the row stays in L1 for the later passes
          float res[kActivationRows][1];
          const int rows = static_cast<int>(std::min<int64_t>(kActivationRows, M - m));
          with_rows(rows, [&](auto r) { dot_rows<W, 1, r()>(wn, K, xf + m * ldx, ldx, K, res); });
          for (int r = 0; r < rows; ++r) store(m + r, n, res[r][0]);
        }
        n += 1;
      }
  });
}

template <typename T>
void dense_mm_for(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const float* bias) {
  if (w.scalar_type() == at::kBFloat16)
    dense_mm_impl<T, c10::BFloat16>(out, x, w, bias);
  else
    dense_mm_impl<T, c10::Half>(out, x, w, bias);
}

}  // namespace

void dense_mm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "dense_mm takes 2-D out, x and w");
  TORCH_CHECK(w.size(1) == x.size(1), "dense_mm: w has ", w.size(1), " columns, x has ", x.size(1));
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.size(0), "dense_mm: out must be [", x.size(0), ", ",
              w.size(0), "], got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "dense_mm: out and x must share a dtype");
  TORCH_CHECK(w.is_contiguous(), "dense_mm: w must be contiguous");
  check_cpu_contiguous_rows(x, "x");
  check_cpu_contiguous_rows(out, "out");
  TORCH_CHECK(w.device().is_cpu(), "w must be on the CPU");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == w.size(0), "dense_mm: bias has ", bias->numel(), " values for ", w.size(0), " rows");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf,
              "dense_mm runs bf16 or fp16 weights, not ", w.scalar_type());
  AT_DISPATCH_SWITCH(x.scalar_type(), "dense_mm", AT_DISPATCH_CASE(at::kFloat, [&] { dense_mm_for<scalar_t>(out, x, w, bp); })
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { dense_mm_for<scalar_t>(out, x, w, bp); })
                     AT_DISPATCH_CASE(at::kHalf, [&] { dense_mm_for<scalar_t>(out, x, w, bp); }));
}

}  // namespace qwenserve::cpu

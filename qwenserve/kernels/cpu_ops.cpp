// Fused CPU kernels for the decoder layer, registered as torch.ops.qwenserve.*.
//
// Each replaces a chain of small PyTorch ops (and their temporaries) with one pass over the data. Roundings
// follow HF transformers' order of operations in the activation dtype, so bfloat16 results match the
// PyTorch path bit for bit where the PyTorch path rounds, and float32 results agree to float rounding.
// Built at first use by qwenserve/kernels/__init__.py with -O3 -march=native; the inner loops are written
// as fixed-width lanes so the compiler vectorises them without -ffast-math.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;

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
// (plain arithmetic, no library call, so loops over it vectorise). Relative error ~2e-7 over [-87, 88].
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float magic = 12582912.0f;
  float n = (x * 1.44269504088896341f + magic) - magic;
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

void check_cpu_contiguous_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// ---- RMSNorm, optionally with the residual add before it ---------------------------------------------------

template <typename T>
void rms_norm_impl(T* out, T* x, T* residual, const T* weight, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n), w(n);
    load_float(w.data(), weight, n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * n;
      if (residual != nullptr) {  // residual <- x + residual; the norm reads the sum
        T* rr = residual + r * n;
        for (int64_t i = 0; i < n; ++i) {
          T s = from_float<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          rr[i] = s;
          buf[i] = static_cast<float>(s);
        }
      } else {
        load_float(buf.data(), xr, n);
      }
      float inv = 1.0f / std::sqrt(sum_of_squares(buf.data(), n) / static_cast<float>(n) + eps);
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = from_float<T>(w[i] * round_to<T>(buf[i] * inv));
    }
  });
}

// out = RMSNorm(x) * weight
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu_contiguous_rows(x, "x");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous tensors");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.size(0) == x.size(-1), "rms_norm: shape mismatch");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type(), "rms_norm: dtype mismatch");
  int64_t n = x.size(-1), rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), nullptr,
                            weight.data_ptr<scalar_t>(), rows, n, static_cast<float>(eps));
  });
}

// In place: residual <- x + residual; x <- RMSNorm(residual) * weight
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_cpu_contiguous_rows(x, "x");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "fused_add_rms_norm needs contiguous tensors");
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.size(0) == x.size(-1), "fused_add_rms_norm: shape mismatch");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "fused_add_rms_norm: dtype mismatch");
  int64_t n = x.size(-1), rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), rows, n, static_cast<float>(eps));
  });
}

// ---- rotary embedding, neox style, in place on the q and k heads of the fused qkv output --------------------

template <typename T>
void rotary_impl(T* qkv, int64_t row_stride, const int64_t* positions, const T* cos_sin, int64_t rows,
                 int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> cos(half), sin(half), x1(half), x2(half);
    for (int64_t r = begin; r < end; ++r) {
      const T* cs = cos_sin + positions[r] * head_dim;
      load_float(cos.data(), cs, half);
      load_float(sin.data(), cs + half, half);
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + r * row_stride + h * head_dim;
        load_float(x1.data(), x, half);
        load_float(x2.data(), x + half, half);
        // HF: x * cos + rotate_half(x) * sin, each product rounded to T before the sum
        for (int64_t i = 0; i < half; ++i) {
          x[i] = from_float<T>(round_to<T>(x1[i] * cos[i]) - round_to<T>(x2[i] * sin[i]));
          x[i + half] = from_float<T>(round_to<T>(x2[i] * cos[i]) + round_to<T>(x1[i] * sin[i]));
        }
      }
    }
  });
}

// qkv: [T, (q_heads + 2 * kv_heads) * head_dim]; the first `heads` heads of each row (q then k) are rotated.
// cos_sin: [positions, head_dim], cos in the first half, sin in the second.
void rotary_embedding(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t heads,
                      int64_t head_dim) {
  check_cpu_contiguous_rows(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) >= heads * head_dim && head_dim % 2 == 0, "rotary_embedding: bad shape");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == qkv.size(0),
              "rotary_embedding: positions must be int64, one per row");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.size(1) == head_dim && cos_sin.scalar_type() == qkv.scalar_type(),
              "rotary_embedding: cos_sin must be [positions, head_dim] in qkv's dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < positions.numel(); ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_sin.size(0), "rotary_embedding: position ", pos[r],
                " is outside the cos/sin table of ", cos_sin.size(0), " positions");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_embedding", [&] {
    rotary_impl<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.stride(0), positions.data_ptr<int64_t>(),
                          cos_sin.data_ptr<scalar_t>(), qkv.size(0), heads, head_dim);
  });
}

// ---- SiLU(gate) * up ------------------------------------------------------------------------------------------

template <typename T>
void silu_and_mul_impl(T* out, const T* x, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(d), up(d);
    for (int64_t r = begin; r < end; ++r) {
      load_float(gate.data(), x + r * 2 * d, d);
      load_float(up.data(), x + r * 2 * d + d, d);
      T* o = out + r * d;
      for (int64_t i = 0; i < d; ++i) {
        float g = gate[i];
        o[i] = from_float<T>(round_to<T>(g / (1.0f + exp_approx(-g))) * up[i]);
      }
    }
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_cpu_contiguous_rows(x, "x");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.size(-1) == 2 * out.size(-1) &&
              x.numel() == 2 * out.numel() && x.scalar_type() == out.scalar_type(), "silu_and_mul: bad shapes");
  int64_t d = out.size(-1), rows = out.numel() / d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), rows, d);
  });
}

// ---- decode attention straight from the paged cache -----------------------------------------------------------

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

// In place: s <- softmax(s)
inline void softmax(float* s, int64_t n) {
  const float m = max_of(s, n);
  for (int64_t i = 0; i < n; ++i) s[i] = exp_approx(s[i] - m);
  const float inv = 1.0f / sum_of(s, n);
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
// element types with a 16-wide AVX-512 load above (double takes the portable path)
template <typename T>
constexpr bool kWideLoad = !std::is_same_v<T, double>;

// q_g . k for the `group` query heads (float, pre-scaled) against one key row of the cache (portable path).
template <typename T>
inline void score_row(float* scores, int64_t stride, const float* query, const T* k, float* row, int64_t group,
                      int64_t head_dim) {
  load_float(row, k, head_dim);
  for (int64_t g = 0; g < group; ++g) scores[g * stride] = dot(query + g * head_dim, row, head_dim);
}

// acc_g += p_g * v for the `group` query heads (portable path).
template <typename T>
inline void accumulate_row(float* acc, const float* probs, int64_t stride, const T* v, float* row, int64_t group,
                           int64_t head_dim) {
  load_float(row, v, head_dim);
  for (int64_t g = 0; g < group; ++g) {
    const float p = probs[g * stride];
    float* a = acc + g * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) a[i] += p * row[i];
  }
}

#if defined(__AVX512F__)
// r[j] = the sum of the 16 lanes of v[j]: a transpose-and-add tree, ~3 instructions per sum instead of a full
// horizontal reduction for each.
inline __m512 sum_lanes_of_16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: partial sums of four vectors, in order
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // fold the four 128-bit lanes, two at a time
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// Walks one kv head of a sequence's keys (or values) token by token through its block table.
template <typename T>
struct PagedRows {
  const T* cache;
  const int64_t* table;
  int64_t block_size, token_stride, block_stride, head_offset;
  int64_t block = 0, offset = 0;
  const T* next() {
    const T* row = cache + table[block] * block_stride + offset * token_stride + head_offset;
    if (++offset == block_size) offset = 0, ++block;
    return row;
  }
};

// One (sequence, kv head) task for head_dim = 16 * C. Scores are made 16 keys at a time, from their float rows
// staged in L1 and reused by every query head; the weighted value sums keep up to 16 accumulators in registers.
template <typename T, int C>
void decode_task_avx512(T* out, const float* query, float* scores, float* staged, int64_t len, int64_t group,
                        PagedRows<T> keys, PagedRows<T> values) {
  constexpr int D = C * 16;
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
    for (int j = 0; j < 16; ++j) {
      const T* k = j < n ? keys.next() : nullptr;
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(staged + j * D + c * 16, k ? load16(k + c * 16) : _mm512_setzero_ps());
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query + g * D;
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(staged + j * D));
        for (int c = 1; c < C; ++c)
          acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c * 16), _mm512_loadu_ps(staged + j * D + c * 16), acc[j]);
      }
      _mm512_mask_storeu_ps(scores + g * len + t0, static_cast<__mmask16>((1u << n) - 1), sum_lanes_of_16(acc));
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * len, len);

  constexpr int kHeadsPerPass = C >= 16 ? 1 : 16 / C;
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
    const int heads = static_cast<int>(std::min<int64_t>(kHeadsPerPass, group - g0));
    __m512 acc[kHeadsPerPass][C];
    for (int h = 0; h < kHeadsPerPass; ++h)
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
    PagedRows<T> rows = values;
    for (int64_t t = 0; t < len; ++t) {
      const T* v = rows.next();
      __m512 value[C];
      for (int c = 0; c < C; ++c) value[c] = load16(v + c * 16);
      for (int h = 0; h < kHeadsPerPass; ++h) {
        if (h >= heads) break;
        const __m512 p = _mm512_set1_ps(scores[(g0 + h) * len + t]);
        for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(p, value[c], acc[h][c]);
      }
    }
    // every accumulator stored with constant indices: indexing acc by the runtime `heads` would keep it in
    // memory instead of registers through the loop above (measured: the whole kernel 10% slower)
    alignas(64) float sums[kHeadsPerPass * D];
    for (int h = 0; h < kHeadsPerPass; ++h)
      for (int c = 0; c < C; ++c) _mm512_store_ps(sums + h * D + c * 16, acc[h][c]);
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < D; ++i) out[(g0 + h) * D + i] = from_float<T>(sums[h * D + i]);
  }
}

// The AVX-512 task for this head_dim if there is one (false: take the portable path).
template <typename T>
bool decode_task_fast(int64_t head_dim, T* out, const float* query, float* scores, float* staged, int64_t len,
                      int64_t group, PagedRows<T> keys, PagedRows<T> values) {
  if constexpr (!kWideLoad<T>) {
    return false;
  } else {
    switch (head_dim) {
      case 32: decode_task_avx512<T, 2>(out, query, scores, staged, len, group, keys, values); return true;
      case 64: decode_task_avx512<T, 4>(out, query, scores, staged, len, group, keys, values); return true;
      case 128: decode_task_avx512<T, 8>(out, query, scores, staged, len, group, keys, values); return true;
      case 256: decode_task_avx512<T, 16>(out, query, scores, staged, len, group, keys, values); return true;
      default: return false;
    }
  }
}
#endif

// One task = one sequence x one kv head: every query head of the group reads each key and value once, in
// place in its cache block (no gather, no padding to the batch's longest context). `row` is scratch: one
// float row on the portable path, 16 staged keys on the AVX-512 one.
template <typename T>
void paged_decode_impl(T* out, const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                       const int64_t* block_tables, int64_t table_width, const int64_t* context_lens, int64_t batch,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * head_dim, block_stride = block_size * token_stride;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), scores, row(16 * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads, len = context_lens[b];
      const int64_t* table = block_tables + b * table_width;
      for (int64_t g = 0; g < group; ++g) {
        const T* qh = q + b * q_row_stride + (kvh * group + g) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) query[g * head_dim + i] = static_cast<float>(qh[i]) * scale;
      }
      scores.resize(group * len);  // [group, len]
      T* task_out = out + (b * heads + kvh * group) * head_dim;
#if defined(__AVX512F__)
      PagedRows<T> keys{k_cache, table, block_size, token_stride, block_stride, kvh * head_dim};
      PagedRows<T> values{v_cache, table, block_size, token_stride, block_stride, kvh * head_dim};
      if (decode_task_fast(head_dim, task_out, query.data(), scores.data(), row.data(), len, group, keys, values))
        continue;
#endif
      for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const int64_t n = std::min(block_size, len - t0);
        const T* k = k_cache + table[blk] * block_stride + kvh * head_dim;
        for (int64_t j = 0; j < n; ++j)
          score_row(scores.data() + t0 + j, len, query.data(), k + j * token_stride, row.data(), group, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) softmax(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const int64_t n = std::min(block_size, len - t0);
        const T* v = v_cache + table[blk] * block_stride + kvh * head_dim;
        for (int64_t j = 0; j < n; ++j)
          accumulate_row(acc.data(), scores.data() + t0 + j, len, v + j * token_stride, row.data(), group, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = task_out + g * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) o[i] = from_float<T>(acc[g * head_dim + i]);
      }
    }
  });
}

// out: [B, heads, head_dim]; q: [B, heads, head_dim] (rows may be strided); caches: [blocks, block_size,
// kv_heads, head_dim]; block_tables: [B, width] int64; context_lens: [B] int64 (keys visible to each query).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  check_cpu_contiguous_rows(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(1) == q.size(2), "paged_decode_attention: q must be [B, heads, head_dim]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "paged_decode_attention: out must be like q, contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "paged_decode_attention: head mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
              block_tables.size(0) == q.size(0), "paged_decode_attention: block_tables must be int64 [B, width]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
              context_lens.numel() == q.size(0), "paged_decode_attention: context_lens must be int64 [B]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "paged_decode_attention: dtype mismatch");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= block_tables.size(1) * k_cache.size(1),
                "paged_decode_attention: context length out of the block table's range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    paged_decode_impl<scalar_t>(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), q.stride(0),
                                k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                block_tables.data_ptr<int64_t>(), block_tables.size(1), lens, q.size(0), q.size(1),
                                k_cache.size(2), q.size(2), k_cache.size(1), static_cast<float>(scale));
  });
}

// ---- greedy sampling: the first index of each row's maximum, as torch.argmax --------------------------------
// (NaN logits are passed over, where torch.argmax would pick them: either way the model is broken)

template <typename T>
int64_t first_argmax(const T* row, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (kWideLoad<T>) {
    if (n >= 16 && n <= INT32_MAX) {
      // one pass: per lane, the largest value so far and the first position holding it
      __m512 lane_max = _mm512_set1_ps(-INFINITY);
      __m512i lane_pos = _mm512_setzero_si512();
      __m512i pos = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i step = _mm512_set1_epi32(16);
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) {
        const __m512 x = load16(row + i);
        const __mmask16 greater = _mm512_cmp_ps_mask(x, lane_max, _CMP_GT_OQ);
        lane_max = _mm512_mask_mov_ps(lane_max, greater, x);
        lane_pos = _mm512_mask_mov_epi32(lane_pos, greater, pos);
        pos = _mm512_add_epi32(pos, step);
      }
      alignas(64) float values[16];
      alignas(64) int32_t positions[16];
      _mm512_store_ps(values, lane_max);
      _mm512_store_si512(positions, lane_pos);
      int64_t best = positions[0];
      float best_value = values[0];
      for (int j = 1; j < 16; ++j)
        if (values[j] > best_value || (values[j] == best_value && positions[j] < best))
          best_value = values[j], best = positions[j];
      for (; i < n; ++i)  // the tail: later positions win only when strictly larger
        if (static_cast<float>(row[i]) > best_value) best_value = static_cast<float>(row[i]), best = i;
      return best;
    }
  }
#endif
  // portable: the maximum first (a vectorised reduction), then its first position
  std::vector<float> values(n);
  load_float(values.data(), row, n);
  const float m = max_of(values.data(), n);
  for (int64_t i = 0; i < n; ++i)
    if (values[i] == m) return i;
  return 0;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_cpu_contiguous_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0, "argmax_rows: logits must be [B, V]");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  int64_t* result = out.data_ptr<int64_t>();
  const int64_t vocab = logits.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) result[r] = first_argmax(data + r * vocab, vocab);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(qwenserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, int heads, int head_dim) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(qwenserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("argmax_rows", &argmax_rows);
}

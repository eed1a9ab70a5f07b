// Decode attention straight from the paged KV cache (paged_decode_attention): one query token per sequence
// against its keys and values read in place in their cache blocks through the block table, with no gather and
// no padding to the batch's longest context. Scores, softmax and the weighted sum stay in float; only the output
// is rounded to the activation dtype. A portable path handles every head_dim and dtype; where AVX-512 is
// available, head_dim 32/64/128/256 take register-blocked kernels that compute the same thing (to float
// rounding: they sum the dot products' lanes in a different order).

#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"
#include "vec.h"

namespace qwenserve::cpu {
namespace {

// In place: s <- softmax(s)
inline void softmax(float* s, int64_t n) {
  const float m = max_of(s, n);
  for (int64_t i = 0; i < n; ++i) s[i] = exp_approx(s[i] - m);
  const float inv = 1.0f / sum_of(s, n);
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

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

}  // namespace

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

}  // namespace qwenserve::cpu

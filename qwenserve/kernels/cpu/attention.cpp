// Decode attention straight from the paged KV cache (paged_decode_attention): one query token per sequence
// against its keys and values read in place in their cache blocks through the block table, with no gather and
// no padding to the batch's longest context. Scores, softmax and the weighted sum stay in float; only the output
// is rounded to the activation dtype. A portable path handles every head_dim and dtype; where AVX-512 is
// available, head_dim 32/64/128/256 take register-blocked kernels that compute the same thing (to float
// rounding: they sum the dot products' lanes in a different order), and where only AVX2 is, head_dim
// 16/32/64/128 take the same kernels 8 lanes wide.
//
// The cache holds either the activation dtype or one-byte codes (int8, fp8 e4m3 / e5m2) with a bf16 scale per
// token and kv head (kv_cache_dtype). Codes are widened to float on the fly inside the dot products; the scales
// factor out of them (q . (s c) = s (q . c), sum_t p_t (s_t c_t) = sum_t (p_t s_t) c_t), so they are applied to
// the scores and to the softmax weights, once per token, not once per element.

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_features.h"
#include "ops.h"
#include "vec.h"

namespace qwenserve::cpu {
namespace {

constexpr int kStaged = 32;  // cache rows widened to float at a time by the vector path (scratch: kStaged rows)

// In place: s <- softmax(s)
inline void softmax(float* s, int64_t n) {
  const float m = max_of(s, n);
  for (int64_t i = 0; i < n; ++i) s[i] = exp_approx(s[i] - m);
  const float inv = 1.0f / sum_of(s, n);
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

// One query head's scores over its n keys -> the weights of its n value rows, in place. For a quantized cache
// the scores are q . codes, so each first takes its key's scale, and each weight then its value's scale
// (k_scales, v_scales: one per token; nullptr for a cache in the activation dtype).
inline void attention_weights(float* s, int64_t n, const float* k_scales, const float* v_scales) {
  if (k_scales)
    for (int64_t i = 0; i < n; ++i) s[i] *= k_scales[i];
  softmax(s, n);
  if (v_scales)
    for (int64_t i = 0; i < n; ++i) s[i] *= v_scales[i];
}

// One kv head's per-token scales along a sequence's block table: scales is [blocks, block_size, kv_heads].
inline void gather_scales(float* dst, const c10::BFloat16* scales, const int64_t* table, int64_t len,
                          int64_t block_size, int64_t kv_heads, int64_t kvh) {
  for (int64_t t = 0; t < len; ++t)
    dst[t] = static_cast<float>(scales[(table[t / block_size] * block_size + t % block_size) * kv_heads + kvh]);
}

// q_g . k for the `group` query heads (float, pre-scaled) against one key row of the cache (portable path).
template <typename E>
inline void score_row(float* scores, int64_t stride, const float* query, const E* k, float* row, int64_t group,
                      int64_t head_dim) {
  load_float(row, k, head_dim);
  for (int64_t g = 0; g < group; ++g) scores[g * stride] = dot(query + g * head_dim, row, head_dim);
}

// acc_g += p_g * v for the `group` query heads (portable path).
template <typename E>
inline void accumulate_row(float* acc, const float* probs, int64_t stride, const E* v, float* row, int64_t group,
                           int64_t head_dim) {
  load_float(row, v, head_dim);
  for (int64_t g = 0; g < group; ++g) {
    const float p = probs[g * stride];
    float* a = acc + g * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) a[i] += p * row[i];
  }
}

#if QS_X86_AVX512F
#define QS_WIDE_DECODE 1
// The vector ops the decode task needs, 16 floats wide.
struct Wide {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kAccumulators = 16;  // of 32 registers: the rest hold a value row
  template <typename E>
  static V load(const E* p) { return load16(p); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store_first(float* p, V v, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
  // r[j] = the sum of the 16 lanes of v[j]: a transpose-and-add tree, ~3 instructions per sum instead of a full
  // horizontal reduction for each.
  static V sum_lanes(const V* v) {
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
};
#elif QS_X86_AVX2
#define QS_WIDE_DECODE 1
// The same, 8 floats wide (AVX2: 16 registers). Measured on 2 AVX2 cores, one Qwen2.5-0.5B layer (14 heads, 2 kv
// heads, head_dim 64, bf16 cache) at 256 tokens of context: 77 us on the portable path, 22 us here.
struct Wide {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kAccumulators = 8;
  template <typename E>
  static V load(const E* p) { return load8(p); }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store_first(float* p, V v, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes), v);
  }
  // r[j] = the sum of the 8 lanes of v[j]: two rounds of hadd (per 128-bit half), then the halves added
  static V sum_lanes(const V* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // v0..v3 per half
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // v4..v7 per half
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
};
#else
#define QS_WIDE_DECODE 0
#endif

#if QS_WIDE_DECODE
// Walks one kv head of a sequence's keys (or values) token by token through its block table.
template <typename E>
struct PagedRows {
  const E* cache;
  const int64_t* table;
  int64_t block_size, token_stride, block_stride, head_offset;
  int64_t blocks;  // the sequence's blocks in the table
  int64_t block = 0, offset = 0;
  const E* next() {
    const E* row = cache + table[block] * block_stride + offset * token_stride + head_offset;
    if (++offset == block_size) offset = 0, ++block;
    if (offset == 1 && block + 1 < blocks) prefetch_block(block + 1);
    return row;
  }
  // The next block's rows, asked for while this block's are used: blocks lie anywhere in the cache, so the
  // hardware prefetcher cannot follow (bundled model, 32 sequences of ~160 tokens, per layer: 201-210 -> 183-186 us)
  void prefetch_block(int64_t b) const {
    const char* first = reinterpret_cast<const char*>(cache + table[b] * block_stride + head_offset);
    for (int64_t t = 0; t < block_size; ++t) _mm_prefetch(first + t * token_stride * sizeof(E), _MM_HINT_T0);
  }
};

// One (sequence, kv head) task for head_dim = W lanes * C. Scores are made W lanes keys at a time, from their
// float rows staged in L1 and reused by every query head; the weighted value sums keep up to kAccumulators
// vectors in registers. T: the activation dtype; E: the cache's element type (T, or codes scaled by k_scales /
// v_scales).
template <typename T, typename E, int C>
void decode_task_wide(T* out, const float* query, float* scores, float* staged, float* sums, int64_t len,
                      int64_t group, PagedRows<E> keys, PagedRows<E> values, const float* k_scales,
                      const float* v_scales) {
  using V = Wide::V;
  constexpr int L = Wide::kLanes, D = C * L;
  for (int64_t t0 = 0; t0 < len; t0 += L) {
    const int n = static_cast<int>(std::min<int64_t>(L, len - t0));
    for (int j = 0; j < L; ++j) {
      const E* k = j < n ? keys.next() : nullptr;
      for (int c = 0; c < C; ++c) Wide::store(staged + j * D + c * L, k ? Wide::load(k + c * L) : Wide::zero());
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query + g * D;
      V acc[L];
      for (int j = 0; j < L; ++j) {
        acc[j] = Wide::mul(Wide::load(qg), Wide::load(staged + j * D));
        for (int c = 1; c < C; ++c)
          acc[j] = Wide::fmadd(Wide::load(qg + c * L), Wide::load(staged + j * D + c * L), acc[j]);
      }
      Wide::store_first(scores + g * len + t0, Wide::sum_lanes(acc), n);
    }
  }
  for (int64_t g = 0; g < group; ++g) attention_weights(scores + g * len, len, k_scales, v_scales);

  constexpr int kHeadsPerPass = C >= Wide::kAccumulators ? 1 : Wide::kAccumulators / C;
  if constexpr (kHeadsPerPass == 1) {
    // Too few registers to keep a value row beside a head's accumulators: value rows are staged as floats,
    // kStaged at a time in L1, and each head sweeps them with its accumulators in registers (its running sums in
    // `sums` between sweeps), so each row is widened once, not once per head.
    std::fill(sums, sums + group * D, 0.0f);
    for (int64_t t0 = 0; t0 < len; t0 += kStaged) {
      const int n = static_cast<int>(std::min<int64_t>(kStaged, len - t0));
      for (int j = 0; j < n; ++j) {
        const E* v = values.next();
        for (int c = 0; c < C; ++c) Wide::store(staged + j * D + c * L, Wide::load(v + c * L));
      }
      for (int64_t g = 0; g < group; ++g) {
        const float* p = scores + g * len + t0;
        V acc[C];
        for (int c = 0; c < C; ++c) acc[c] = Wide::load(sums + g * D + c * L);
        for (int j = 0; j < n; ++j) {
          const V pj = Wide::set1(p[j]);
          for (int c = 0; c < C; ++c) acc[c] = Wide::fmadd(pj, Wide::load(staged + j * D + c * L), acc[c]);
        }
        for (int c = 0; c < C; ++c) Wide::store(sums + g * D + c * L, acc[c]);
      }
    }
    for (int64_t i = 0; i < group * D; ++i) out[i] = from_float<T>(sums[i]);
    return;
  }
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
    const int heads = static_cast<int>(std::min<int64_t>(kHeadsPerPass, group - g0));
    V acc[kHeadsPerPass][C];
    for (int h = 0; h < kHeadsPerPass; ++h)
      for (int c = 0; c < C; ++c) acc[h][c] = Wide::zero();
    PagedRows<E> rows = values;
    for (int64_t t = 0; t < len; ++t) {
      const E* v = rows.next();
      V value[C];
      for (int c = 0; c < C; ++c) value[c] = Wide::load(v + c * L);
      for (int h = 0; h < kHeadsPerPass; ++h) {
        if (h >= heads) break;
        const V p = Wide::set1(scores[(g0 + h) * len + t]);
        for (int c = 0; c < C; ++c) acc[h][c] = Wide::fmadd(p, value[c], acc[h][c]);
      }
    }
    // every accumulator stored with constant indices: indexing acc by the runtime `heads` would keep it in
    // memory instead of registers through the loop above (measured: the whole kernel 10% slower)
    for (int h = 0; h < kHeadsPerPass; ++h)
      for (int c = 0; c < C; ++c) Wide::store(sums + h * D + c * L, acc[h][c]);
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < D; ++i) out[(g0 + h) * D + i] = from_float<T>(sums[h * D + i]);
  }
}

// The vector task for this head_dim if there is one (false: take the portable path).
template <typename T, typename E>
bool decode_task_fast(int64_t head_dim, T* out, const float* query, float* scores, float* staged, float* sums,
                      int64_t len, int64_t group, PagedRows<E> keys, PagedRows<E> values, const float* k_scales,
                      const float* v_scales) {
  if constexpr (!kWideLoad<E>) {
    return false;
  } else {
    const auto task = [&](auto c) {
      decode_task_wide<T, E, decltype(c)::value>(out, query, scores, staged, sums, len, group, keys, values,
                                                 k_scales, v_scales);
      return true;
    };
    if (head_dim % Wide::kLanes != 0) return false;
    switch (head_dim / Wide::kLanes) {
      case 2: return task(std::integral_constant<int, 2>{});
      case 4: return task(std::integral_constant<int, 4>{});
      case 8: return task(std::integral_constant<int, 8>{});
      case 16: return task(std::integral_constant<int, 16>{});
      default: return false;
    }
  }
}
#endif

// One task = one sequence x one kv head: every query head of the group reads each key and value once, in
// place in its cache block (no gather, no padding to the batch's longest context). `row` is scratch: one
// float row on the portable path, 16 staged keys on the vector one. E is the cache's element type: T, or
// codes with their scales in k_scales / v_scales ([blocks, block_size, kv_heads]; nullptr for T).
template <typename T, typename E>
void paged_decode_impl(T* out, const T* q, int64_t q_row_stride, const E* k_cache, const E* v_cache,
                       const c10::BFloat16* k_scales, const c10::BFloat16* v_scales, const int64_t* block_tables,
                       int64_t table_width, const int64_t* context_lens, int64_t batch, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * head_dim, block_stride = block_size * token_stride;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(std::max<int64_t>(group, 16) * head_dim), scores,
        row(kStaged * head_dim), ks, vs;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads, len = context_lens[b];
      const int64_t* table = block_tables + b * table_width;
      for (int64_t g = 0; g < group; ++g) {
        const T* qh = q + b * q_row_stride + (kvh * group + g) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) query[g * head_dim + i] = static_cast<float>(qh[i]) * scale;
      }
      scores.resize(group * len);  // [group, len]
      if (k_scales) {
        ks.resize(len), vs.resize(len);
        gather_scales(ks.data(), k_scales, table, len, block_size, kv_heads, kvh);
        gather_scales(vs.data(), v_scales, table, len, block_size, kv_heads, kvh);
      }
      const float* k_scale = k_scales ? ks.data() : nullptr;
      const float* v_scale = v_scales ? vs.data() : nullptr;
      T* task_out = out + (b * heads + kvh * group) * head_dim;
#if QS_WIDE_DECODE
      const int64_t blocks = (len + block_size - 1) / block_size;
      PagedRows<E> keys{k_cache, table, block_size, token_stride, block_stride, kvh * head_dim, blocks};
      PagedRows<E> values{v_cache, table, block_size, token_stride, block_stride, kvh * head_dim, blocks};
      if (decode_task_fast(head_dim, task_out, query.data(), scores.data(), row.data(), acc.data(), len, group,
                           keys, values, k_scale, v_scale))
        continue;
#endif
      for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const int64_t n = std::min(block_size, len - t0);
        const E* k = k_cache + table[blk] * block_stride + kvh * head_dim;
        for (int64_t j = 0; j < n; ++j)
          score_row(scores.data() + t0 + j, len, query.data(), k + j * token_stride, row.data(), group, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) attention_weights(scores.data() + g * len, len, k_scale, v_scale);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const int64_t n = std::min(block_size, len - t0);
        const E* v = v_cache + table[blk] * block_stride + kvh * head_dim;
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
// kv_heads, head_dim] in q's dtype, or int8 / fp8 codes with bf16 scales [blocks, block_size, kv_heads];
// block_tables: [B, width] int64; context_lens: [B] int64 (keys visible to each query).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales) {
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
  const at::ScalarType codes = k_cache.scalar_type();
  const bool quantized = codes == at::kChar || codes == at::kFloat8_e4m3fn || codes == at::kFloat8_e5m2;
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && v_cache.scalar_type() == codes &&
              (quantized || codes == q.scalar_type()), "paged_decode_attention: dtype mismatch");
  TORCH_CHECK(k_scales.has_value() == quantized && v_scales.has_value() == quantized,
              "paged_decode_attention: int8 / fp8 caches need k_scales and v_scales, other caches none");
  for (const auto* s : {&k_scales, &v_scales})
    TORCH_CHECK(!quantized || ((*s)->scalar_type() == at::kBFloat16 && (*s)->is_contiguous() &&
                               (*s)->sizes() == k_cache.sizes().slice(0, 3)),
                "paged_decode_attention: scales must be contiguous bfloat16 [blocks, block_size, kv_heads]");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= block_tables.size(1) * k_cache.size(1),
                "paged_decode_attention: context length out of the block table's range");
  const c10::BFloat16* ks = quantized ? k_scales->data_ptr<c10::BFloat16>() : nullptr;
  const c10::BFloat16* vs = quantized ? v_scales->data_ptr<c10::BFloat16>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const auto run = [&](auto element) {
      using E = decltype(element);
      paged_decode_impl<scalar_t, E>(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), q.stride(0),
                                     k_cache.data_ptr<E>(), v_cache.data_ptr<E>(), ks, vs,
                                     block_tables.data_ptr<int64_t>(), block_tables.size(1), lens, q.size(0),
                                     q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                                     static_cast<float>(scale));
    };
    switch (codes) {
      case at::kChar: return run(int8_t{});
      case at::kFloat8_e4m3fn: return run(c10::Float8_e4m3fn{});
      case at::kFloat8_e5m2: return run(c10::Float8_e5m2{});
      default: return run(scalar_t{});
    }
  });
}

}  // namespace qwenserve::cpu

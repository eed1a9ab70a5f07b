// Greedy sampling (argmax_rows): the first index of each row's maximum, as torch.argmax, for a batch of logits
// rows in parallel. With AVX-512, one pass keeps per lane the largest value so far and its first position;
// the portable path finds the maximum with a vectorised reduction, then its first position. Both return the
// same index. (NaN logits are passed over, where torch.argmax would pick them: either way the model is broken.)

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_features.h"
#include "ops.h"
#include "vec.h"

namespace qwenserve::cpu {
namespace {

template <typename T>
int64_t first_argmax(const T* row, int64_t n) {
#if QS_X86_AVX512F
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

}  // namespace

// logits: [B, V] -> [B] int64
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

}  // namespace qwenserve::cpu

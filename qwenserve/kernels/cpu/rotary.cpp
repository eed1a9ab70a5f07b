// Rotary position embedding, neox style, in place on the q and k heads of the fused qkv projection's output
// (rotary_embedding): no split, no copies of q and k, and the cos/sin rows looked up by position once per token
// for all its heads. Each product is rounded to the activation dtype before the sum, as HF does, so bfloat16
// results are bit-identical to the PyTorch path.

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_features.h"
#include "ops.h"
#include "vec.h"

namespace qwenserve::cpu {
namespace {

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

}  // namespace

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

}  // namespace qwenserve::cpu

// SiLU(gate) * up for the MLP (silu_and_mul): reads the fused gate/up projection's output once and writes the
// product, with no gate, up or SiLU temporaries. SiLU is rounded to the activation dtype before the multiply,
// as F.silu(gate) * up does, so bfloat16 results are bit-identical to the PyTorch path.

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_features.h"
#include "ops.h"
#include "vec.h"

namespace qwenserve::cpu {
namespace {

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

}  // namespace

// x: [..., 2 * d], gate then up; out: [..., d]
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_cpu_contiguous_rows(x, "x");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.size(-1) == 2 * out.size(-1) &&
              x.numel() == 2 * out.numel() && x.scalar_type() == out.scalar_type(), "silu_and_mul: bad shapes");
  int64_t d = out.size(-1), rows = out.numel() / d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), rows, d);
  });
}

}  // namespace qwenserve::cpu

// RMSNorm, optionally with the residual add before it (rms_norm, fused_add_rms_norm): one pass per row that
// adds, squares, scales and writes, where the PyTorch path makes several temporaries. The product is rounded
// to the activation dtype before the weight multiplies it, as HF does, so bfloat16 results are bit-identical.

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_features.h"
#include "ops.h"
#include "vec.h"

namespace qwenserve::cpu {
namespace {

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

}  // namespace

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

}  // namespace qwenserve::cpu

// The stacked LoRA products of a decode-sized step (qwenserve/lora/ops.py): y[t] += (x[t] A_s^T) B_s for each
// row t whose slot position s = row_slots[t] is not -1. Each slot's weights are read once for all of its rows, in
// the run dtype (PyTorch's batched matmuls would want them in float32 to be fast, twice the bytes), and the
// shrunk activations stay in float32 between the two products, so y is rounded once.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace qwenserve::cpu {
namespace {

// output columns per expand work item: the float accumulators of a slot's rows stay in L1/L2 while each B row
// chunk streams through
constexpr int64_t kColumns = 256;

template <typename T>
void lora_add_impl(T* y, const T* x, const T* a, const T* b, const int64_t* row_slots, int64_t rows,
                   int64_t slots, int64_t columns, int64_t in, int64_t out) {
  std::vector<std::vector<int64_t>> rows_of(slots);
  for (int64_t t = 0; t < rows; ++t)
    if (row_slots[t] >= 0) rows_of[row_slots[t]].push_back(t);
  std::vector<float> xf(rows * in);
  for (int64_t t = 0; t < rows; ++t)
    if (row_slots[t] >= 0) load_float(xf.data() + t * in, x + t * in, in);

  // shrink: one work item per (slot, shrunk column), the A row converted once for all the slot's rows
  std::vector<float> shrunk(rows * columns, 0.0f);
  at::parallel_for(0, slots * columns, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> a_row(in);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / columns, c = item % columns;
      if (rows_of[s].empty()) continue;
      load_float(a_row.data(), a + item * in, in);
      for (int64_t t : rows_of[s]) shrunk[t * columns + c] = dot(xf.data() + t * in, a_row.data(), in);
    }
  });

  // expand: one work item per (slot, chunk of output columns)
  const int64_t chunks = (out + kColumns - 1) / kColumns;
  at::parallel_for(0, slots * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> b_row(kColumns), acc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / chunks, first = (item % chunks) * kColumns;
      const int64_t width = std::min(kColumns, out - first);
      const std::vector<int64_t>& mine = rows_of[s];
      if (mine.empty()) continue;
      acc.assign(mine.size() * kColumns, 0.0f);
      for (int64_t c = 0; c < columns; ++c) {
        load_float(b_row.data(), b + (s * columns + c) * out + first, width);
        for (size_t r = 0; r < mine.size(); ++r) {
          const float scale = shrunk[mine[r] * columns + c];
          float* dst = acc.data() + r * kColumns;
          for (int64_t j = 0; j < width; ++j) dst[j] += scale * b_row[j];
        }
      }
      for (size_t r = 0; r < mine.size(); ++r) {
        T* dst = y + mine[r] * out + first;
        const float* src = acc.data() + r * kColumns;
        for (int64_t j = 0; j < width; ++j) dst[j] = from_float<T>(static_cast<float>(dst[j]) + src[j]);
      }
    }
  });
}

}  // namespace

// y: [T, out], x: [T, in], a: [S, C, in] (each slot's A, one row per shrunk column, zero rows as padding),
// b: [S, C, out] (each slot's scaled B^T placed at its output columns), row_slots: int64 [R <= T], each row's
// slot position or -1; rows from R on are left alone. All contiguous, one dtype.
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& row_slots) {
  TORCH_CHECK(y.device().is_cpu() && y.is_contiguous() && x.is_contiguous() && a.is_contiguous() &&
                  b.is_contiguous() && row_slots.is_contiguous(), "lora_add: CPU tensors, contiguous");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 3 && row_slots.dim() == 1,
              "lora_add: y [T, out], x [T, in], a [S, C, in], b [S, C, out], row_slots [R]");
  TORCH_CHECK(x.size(0) == y.size(0) && row_slots.size(0) <= y.size(0) && a.size(0) == b.size(0) &&
                  a.size(1) == b.size(1) && a.size(2) == x.size(1) && b.size(2) == y.size(1),
              "lora_add: shapes do not agree");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong, "lora_add: row_slots must be int64");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  b.scalar_type() == y.scalar_type(), "lora_add: y, x, a and b in one dtype");
  const int64_t slots = a.size(0);
  const int64_t* positions = row_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < row_slots.size(0); ++t)
    TORCH_CHECK(positions[t] >= -1 && positions[t] < slots, "lora_add: row_slots[", t, "] = ", positions[t],
                " is not a slot position (-1 or 0..", slots - 1, ")");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_add", [&] {
    lora_add_impl<scalar_t>(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(),
                            b.data_ptr<scalar_t>(), positions, row_slots.size(0), slots, a.size(1), x.size(1),
                            y.size(1));
  });
}

}  // namespace qwenserve::cpu

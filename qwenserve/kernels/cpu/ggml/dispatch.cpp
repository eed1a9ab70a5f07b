// Linear layers straight on ggml-quantized weights (ggml_mm) and ggml block decoding (ggml_dequantize), for
// Q4_0, Q4_1, Q5_0, Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K (super-blocks of 256): the drivers and the entry
// points, which pick for each call the kernels this build has.
//
// ggml_mm works as llama.cpp does on the CPU: every activation row is quantized once per call, to blocks of 32
// int8 with one scale (q8_0, for the 32-blocks) or of 256 with one fp32 scale and sums of 16 (q8_K, for the
// K-quants), exactly as ggml's reference quantizers; each (weight block, activation block) pair then gives an
// exact integer dot product, which is scaled and accumulated in float (act_levels 2, for float32 runs: what each
// row's codes leave is quantized as one more row, and the two rows' results summed). Work is split over weight
// rows (each weight byte is read once per call: decode is memory-bound), and every decoded weight block serves up
// to 4 activation rows. At one activation row (decode) weights held in the decode layout (rows in groups of 8, a
// block of each side by side: see Layout) go 8 rows at a time, read ahead in software: measured on 2 AVX2 cores
// with the bundled model's weights from memory, 1.0x (Q6_K) to 1.5x (Q5_0) the speed of row by row in the file's
// layout. With AVX512-VNNI, from 4 activation rows a group of 8 weight rows is decoded once per call and swept by
// all activation rows, 16 at a time (mm_tiles); from 16 activation rows, groups of 16 weight rows, one per int32
// lane (mm_tiles16); where the CPU has AMX, the K-quants from kAmxMinRows activation rows go to AMX tile
// multiplies instead (mm_amx: 16 activation rows x 16 weight rows x 64 codes each), and in bf16 runs the 32-blocks
// from kAmxBf16MinRows rows to bf16 ones on weights decoded to bf16, the activations unquantized (mm_amx_bf16).
// On AVX2 without AVX512-VNNI the same from kAvx2TileMinRows activation rows in 256-bit vectors: a group of 8
// weight rows decoded once per call, one row per int32 lane, swept by all activation rows 8 at a time
// (mm_avx2_tiles: maddubs + madd with int16 sums kept exact, Q8_0 by the sign trick and from 16 rows, or vpdpbusd
// where the build has 256-bit VNNI). On
// ARM with i8mm the same from 4 activation rows: a group of 8 weight rows decoded once per call into smmla's
// operands and swept by the activation rows two at a time (arch/arm/i8mm.h).
//
// Where the kernels live (the include path is cpu/):
//   ggml/common.h          block layouts, activation blocks, kernel types, row layouts
//   ggml/drivers.h         the activation quantizers' and the matmul's drivers (below: which kernel runs when),
//                          shared with ggml/experts.cpp (ggml_moe: a layer's experts on their blocks)
//   ggml/quants_ref.*      the scalar reference, built on every CPU: what runs where no arch/ kernel applies
//   arch/x86/avx2.h        AVX2 block decoders and dot products (one row, and 8 rows of the decode layout), and
//                          the q8_K activation quantizer
//   arch/x86/avx512.h      the AVX-512 q8_0 activation quantizer and 512-bit decode kernels: the 4-bit
//                          32-blocks' (dot8_legacy512) and the K-quants' (dot8_kquant512)
//   arch/x86/vnni_tiles.h  the AVX512-VNNI tile kernels for many activation rows
//   arch/x86/amx_tiles.h   the AMX int8 tile kernel for the K-quants (AVX512-BF16 builds, where CPU and OS allow)
//   arch/x86/amx_bf16_tiles.h  the AMX bf16 tile kernel for the 32-blocks in bf16 runs (the same builds)
//   arch/x86/avx2_tiles.h  the 256-bit tile kernels for many activation rows, where the build lacks AVX512-VNNI
//   arch/x86/dequantize.h  x86 block dequantizing
//   arch/arm/neon.h        aarch64 NEON block decoders, activation quantizers and block dequantizing
//   arch/arm/dotprod.h     aarch64 dot products (sdot where the CPU has dotprod; one row, and 8 rows of the
//                          decode layout)
//   arch/arm/i8mm.h        the aarch64 i8mm (smmla) tile kernel for many activation rows
// Each CPU family has its arch/<family>/ with its feature macros in cpu_features.h, and a branch in drivers.h
// beside each other family's. The ARM kernels are tested under emulation (tests/test_arm_kernels.py); their speed is
// unmeasured.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ggml/drivers.h"
#include "ops.h"

namespace qwenserve::cpu {
namespace ggml {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Linear layers

template <typename Kernel, typename T>
void mm_impl(T* out, int64_t ldo, const T* x, int64_t M, int64_t K, const Layout& w, int64_t N, const float* bias,
             int64_t act_levels) {
  const int64_t nb = K / Kernel::kBlock;
#if QS_X86_AMX_BUILD
  if constexpr (std::is_same_v<T, at::BFloat16> && x86::kAmxBf16Tiles<Kernel>)
    if (act_levels == 1 && w.group == kDecodeGroup && M >= x86::kAmxBf16MinRows && N % 16 == 0 &&
        x86::use_amx_bf16()) {
      x86::mm_amx_bf16<Kernel>(out, ldo, x, M, K, w, N, bias);
      return;
    }
#endif
  // act_levels 2: each row's remainder runs as one more activation row beside it, through the same kernels (the
  // weights are decoded once for both), and the stores sum the pair
  std::vector<typename Kernel::Act> act(static_cast<size_t>(activation_rows_allocated(act_levels * M) * nb));
  quantize_rows(x, M, K, act_levels, act.data());
  mm_quantized<Kernel>(out, ldo, act_levels, act, act_levels * M, nb, w, N, bias);
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantizing

template <typename T>
void dequantize_impl(const Layout& w, int64_t type, int64_t rows, int64_t cols, T* out) {
  const BlockInfo bi = block_info(type);
  const int64_t nb = cols / bi.elems;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t r0, int64_t r1) {
    [[maybe_unused]] float buf[256];  // the reference's block
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        T* o = out + r * cols + b * bi.elems;
        const uint8_t* blk = w.row(r) + b * w.block_stride();
#if QS_X86_AVX2
        x86::dequantize_block(type, blk, o);
#elif QS_ARM_NEON
        arm::dequantize_block(type, blk, o);
#else
        if constexpr (std::is_same_v<T, float>) {
          ref::dequantize_block(type, blk, o);
        } else {
          ref::dequantize_block(type, blk, buf);
          for (int64_t j = 0; j < bi.elems; ++j) o[j] = from_float<T>(buf[j]);
        }
#endif
      }
  });
}

// raw's layout, checked against the type, the columns and (when given) the rows
Layout checked_layout(const at::Tensor& raw, int64_t type, int64_t cols, int64_t rows_expected, int64_t group) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2,
              "ggml: raw must be a 2-D uint8 CPU tensor [rows, row_bytes]");
  TORCH_CHECK(raw.stride(1) == 1 || raw.size(1) <= 1, "ggml: raw rows must be contiguous");
  const BlockInfo bi = block_info(type);
  TORCH_CHECK(cols > 0 && cols % bi.elems == 0, "ggml type ", type, ": cols (", cols, ") must be a multiple of ",
              bi.elems);
  TORCH_CHECK(raw.size(1) == cols / bi.elems * bi.bytes, "ggml type ", type, ": ", cols, " columns take ",
              cols / bi.elems * bi.bytes, " bytes a row, raw has ", raw.size(1));
  if (rows_expected >= 0) TORCH_CHECK(raw.size(0) == rows_expected, "ggml_mm: raw has ", raw.size(0),
                                      " rows, out has ", rows_expected, " columns");
  TORCH_CHECK(group == 1 || group == kDecodeGroup, "ggml: rows are grouped by 1 or ", kDecodeGroup, ", not ", group);
  TORCH_CHECK(group == 1 || (raw.is_contiguous() && raw.size(0) % group == 0), "ggml: rows grouped by ", group,
              " need a contiguous raw with a multiple of ", group, " rows (it has ", raw.size(0), ")");
  return {raw.data_ptr<uint8_t>(), raw.stride(0), group, bi.bytes};
}

}  // namespace
}  // namespace ggml

// raw: uint8 [rows, cols / block_elems * block_bytes], rows grouped by `group` (see Layout) -> [rows, cols] in
// dtype (float32, bfloat16, float16)
at::Tensor ggml_dequantize(const at::Tensor& raw, int64_t ggml_type, int64_t cols, at::ScalarType dtype,
                           int64_t group) {
  const ggml::Layout w = ggml::checked_layout(raw, ggml_type, cols, -1, group);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "ggml_dequantize: dtype must be float32, bfloat16 or float16");
  const int64_t rows = raw.size(0);
  at::Tensor out = at::empty({rows, cols}, raw.options().dtype(dtype));
  if (rows == 0) return out;
  QS_GGML_DISPATCH_DTYPES(dtype, "ggml_dequantize", [&] {
    ggml::dequantize_impl<scalar_t>(w, ggml_type, rows, cols, out.data_ptr<scalar_t>());
  });
  return out;
}

// out[M, N] = x[M, K] @ dequant(raw[N, ...])^T (+ bias[N]) with x quantized to q8_0 / q8_K per row (see the top of
// the file). out's rows may be strided (a column slice of a wider output); x contiguous in float32, bfloat16 or
// float16; bias contiguous float32, added before the one rounding to out's dtype (saves a separate add per call).
void ggml_mm(at::Tensor& out, const at::Tensor& x, const at::Tensor& raw, int64_t ggml_type, int64_t group,
             const std::optional<at::Tensor>& bias, int64_t act_levels) {
  using namespace ggml;
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "ggml_mm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous(), "ggml_mm: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(out.size(0) == x.size(0) && (out.stride(1) == 1 || out.size(1) <= 1),
              "ggml_mm: out must be [M, N] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "ggml_mm: out and x must have the same dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "ggml_mm: x must be float32, bfloat16 or float16");
  TORCH_CHECK(act_levels == 1 || act_levels == 2, "ggml_mm: act_levels must be 1 or 2, not ", act_levels);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const Layout w = checked_layout(raw, ggml_type, K, N, group);
  if (M == 0 || N == 0) return;
  const int64_t ldo = out.stride(0);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "ggml_mm: bias must be a contiguous float32 vector of ", N, " (out's columns)");
    bp = bias->data_ptr<float>();
  }
  QS_GGML_DISPATCH_DTYPES(x.scalar_type(), "ggml_mm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    with_kernel(ggml_type, [&](auto* kernel) {  // checked_layout rejected any other type
      mm_impl<std::remove_pointer_t<decltype(kernel)>>(op, ldo, xp, M, K, w, N, bp, act_levels);
    });
  });
}

// Whether the int8 tile kernels (AVX512-VNNI, or AVX2's 256-bit ones) run this type: the layers then leave the
// dense route to the tuning table's tile thresholds (docs/tuning.md, "Tiles").
bool ggml_mm_tiles(int64_t ggml_type) {
  using namespace ggml;
  switch (ggml_type) {
#if QS_X86_AVX512_VNNI
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
#elif QS_X86_AVX2
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
#endif
    default: return false;
  }
}

// Whether ggml_mm runs the AMX int8 tile kernel for the K-quants from kAmxMinRows activation rows (the build has
// it, the CPU and the OS allow it, and ggml_allow_amx has not turned it off)
bool ggml_amx_tiles() {
#if QS_X86_AMX_BUILD
  return ggml::x86::use_amx();
#else
  return false;
#endif
}

// Whether ggml_mm runs the AMX bf16 tile kernel for the 32-blocks in bf16 runs from kAmxBf16MinRows activation
// rows (as ggml_amx_tiles, with AMX-BF16)
bool ggml_amx_bf16_tiles() {
#if QS_X86_AMX_BUILD
  return ggml::x86::use_amx_bf16();
#else
  return false;
#endif
}

// Lets ggml_mm take the AMX kernels where it can (the default), or keeps it to the AVX512-VNNI sweeps: benchmarks
// and tests compare the two on one CPU
void ggml_allow_amx(bool allow) {
#if QS_X86_AMX_BUILD
  ggml::x86::amx_allowed().store(allow);
#else
  (void)allow;
#endif
}

}  // namespace qwenserve::cpu

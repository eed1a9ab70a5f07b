// A mixture-of-experts layer's experts straight on their ggml blocks (ggml_moe): each expert a SiLU-gated MLP,
// down(silu(gate x) * up x), and each token's output the sum of its k chosen experts' outputs weighted by the router.
//
// One call per layer: the activations are quantized once, for each activation block the gate and up types take
// (q8_0 for the 32-blocks, q8_K for the K-quants); the (token, slot) pairs are grouped by expert with a counting sort
// (stable: an expert sees its tokens in order); and each expert that has tokens gathers its tokens' quantized rows,
// runs gate and up through mm_quantized (drivers.h: the decode-group kernels at one token, the tile kernels from a
// few), forms h = silu(gate) * up in float, quantizes h for the down type, runs down, and adds weight * result to its
// tokens' rows of a float32 sum, which is rounded once to out's dtype at the end. Only the chosen experts' bytes
// are read. The experts run one after another and each matmul splits its weight rows over the threads, as ggml_mm
// does: the threads share every expert's work however unevenly the tokens fall on the experts.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ggml/drivers.h"
#include "ops.h"

namespace qwenserve::cpu {
namespace ggml {
namespace {

bool takes_q8_K(int64_t type) { return block_info(type).elems == 256; }

// One projection of every expert, stacked: raw [experts, rows, row bytes], each expert's rows in the layout
// `group` says (see Layout)
struct ExpertWeights {
  const uint8_t* base;
  int64_t type, rows, cols, expert_bytes, row_bytes, block_bytes, group;
  Layout of(int64_t expert) const { return {base + expert * expert_bytes, row_bytes, group, block_bytes}; }
};

ExpertWeights checked_experts(const at::Tensor& raw, const char* name, int64_t type, int64_t experts, int64_t cols,
                              int64_t group) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 3 && raw.is_contiguous(),
              "ggml_moe: ", name, " must be a contiguous 3-D uint8 CPU tensor [experts, rows, row_bytes]");
  const BlockInfo bi = block_info(type);
  TORCH_CHECK(raw.size(0) == experts, "ggml_moe: ", name, " holds ", raw.size(0), " experts, gate holds ", experts);
  TORCH_CHECK(cols % bi.elems == 0, "ggml_moe: ", name, " is ggml type ", type, ", whose blocks hold ", bi.elems,
              " weights; its rows of ", cols, " weights are not whole blocks");
  TORCH_CHECK(raw.size(2) == cols / bi.elems * bi.bytes, "ggml_moe: ", name, " (ggml type ", type, ") has rows of ",
              raw.size(2), " bytes; ", cols, " weights take ", cols / bi.elems * bi.bytes);
  TORCH_CHECK(raw.size(1) > 0 && raw.size(1) % group == 0, "ggml_moe: ", name, " has ", raw.size(1),
              " rows per expert, not a positive multiple of the group (", group, ")");
  return {raw.data_ptr<uint8_t>(), type, raw.size(1), cols, raw.size(1) * raw.size(2), raw.size(2), bi.bytes, group};
}

// out[M / levels, N] in float (rows ldo apart) from M quantized rows against weight rows of `type`
template <typename Act>
void mm_float(int64_t type, float* out, int64_t ldo, int64_t levels, const std::vector<Act>& act, int64_t M,
              int64_t nb, const Layout& w, int64_t N) {
  if constexpr (std::is_same_v<Act, ActQ8_0>) {
    switch (type) {
      case kQ4_0: mm_quantized<LegacyUnsigned<kQ4_0>>(out, ldo, levels, act, M, nb, w, N, nullptr); return;
      case kQ4_1: mm_quantized<LegacyUnsigned<kQ4_1>>(out, ldo, levels, act, M, nb, w, N, nullptr); return;
      case kQ5_0: mm_quantized<LegacyUnsigned<kQ5_0>>(out, ldo, levels, act, M, nb, w, N, nullptr); return;
      case kQ8_0: mm_quantized<Q8_0Kernel>(out, ldo, levels, act, M, nb, w, N, nullptr); return;
      default: break;
    }
  } else {
    switch (type) {
      case kQ4_K: mm_quantized<KQuant45<kQ4_K>>(out, ldo, levels, act, M, nb, w, N, nullptr); return;
      case kQ5_K: mm_quantized<KQuant45<kQ5_K>>(out, ldo, levels, act, M, nb, w, N, nullptr); return;
      case kQ6_K: mm_quantized<Q6_KKernel>(out, ldo, levels, act, M, nb, w, N, nullptr); return;
      default: break;
    }
  }
  TORCH_CHECK(false, "ggml_moe: ggml type ", type, " reached the wrong activation blocks");  // checked before
}

// One kind of activation block (q8_0 or q8_K) of the call's tokens: quantized once, gathered per expert
template <typename Act>
struct QuantizedTokens {
  std::vector<Act> rows;  // every token's `levels` rows
  int64_t nb = 0, levels = 1;

  template <typename T>
  void quantize(const T* x, int64_t tokens, int64_t K, int64_t act_levels) {
    nb = K / (std::is_same_v<Act, ActQ8_0> ? 32 : 256);
    levels = act_levels;
    rows.resize(static_cast<size_t>(tokens * levels * nb));
    quantize_rows(x, tokens, K, levels, rows.data());
  }

  // The rows of the tokens pairs[i] / k, in order, allocated as mm_quantized needs (padding zero)
  std::vector<Act> gather(const int64_t* pairs, int64_t count, int64_t k) const {
    std::vector<Act> out(static_cast<size_t>(activation_rows_allocated(levels * count) * nb));
    const int64_t per_token = levels * nb;
    for (int64_t i = 0; i < count; ++i) {
      const Act* src = rows.data() + pairs[i] / k * per_token;
      std::copy(src, src + per_token, out.data() + i * per_token);
    }
    return out;
  }
};

// (token, slot) pairs, p = token * k + slot, grouped by expert: expert e's are order[start[e] .. start[e + 1])
struct PairsByExpert {
  std::vector<int64_t> start, order;
};

PairsByExpert group_by_expert(const int64_t* ids, int64_t pairs, int64_t k, int64_t experts) {
  PairsByExpert g{std::vector<int64_t>(static_cast<size_t>(experts + 1), 0),
                  std::vector<int64_t>(static_cast<size_t>(pairs))};
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < experts, "ggml_moe: expert id ", ids[p], " (token ", p / k, ", slot ",
                p % k, ") is out of range: the layer has ", experts, " experts");
    ++g.start[ids[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) g.order[next[ids[p]]++] = p;
  return g;
}

// One projection (gate, up: `rows` output columns at out + column) of expert e for its `count` tokens
void project(const ExpertWeights& w, int64_t e, const int64_t* pairs, int64_t count, int64_t k,
             const QuantizedTokens<ActQ8_0>& x32, const QuantizedTokens<ActQ8_K>& x256, float* out, int64_t ldo) {
  if (takes_q8_K(w.type)) {
    mm_float(w.type, out, ldo, x256.levels, x256.gather(pairs, count, k), x256.levels * count, x256.nb, w.of(e),
             w.rows);
  } else {
    mm_float(w.type, out, ldo, x32.levels, x32.gather(pairs, count, k), x32.levels * count, x32.nb, w.of(e), w.rows);
  }
}

// down(h) for h [count, inter] in float: h quantized for down's type, then the matmul into y [count, hidden]
template <typename Act>
void down_project(const ExpertWeights& down, int64_t e, const std::vector<float>& h, int64_t count, int64_t inter,
                  int64_t levels, float* y) {
  const int64_t nb = inter / (std::is_same_v<Act, ActQ8_0> ? 32 : 256);
  std::vector<Act> act(static_cast<size_t>(activation_rows_allocated(levels * count) * nb));
  quantize_rows(h.data(), count, inter, levels, act.data());
  mm_float(down.type, y, down.rows, levels, act, levels * count, nb, down.of(e), down.rows);
}

// gate: [experts, inter, ...], or gate then up rows [experts, 2 inter, ...] where up is null
template <typename T>
void moe_impl(T* out, const T* x, int64_t tokens, int64_t hidden, const int64_t* ids, const float* weights,
              int64_t k, int64_t experts, const ExpertWeights& gate, const ExpertWeights* up,
              const ExpertWeights& down, int64_t inter, int64_t levels) {
  const PairsByExpert by_expert = group_by_expert(ids, tokens * k, k, experts);
  QuantizedTokens<ActQ8_0> x32;
  QuantizedTokens<ActQ8_K> x256;
  const bool any_q8_K = takes_q8_K(gate.type) || (up && takes_q8_K(up->type));
  const bool any_q8_0 = !takes_q8_K(gate.type) || (up && !takes_q8_K(up->type));
  if (any_q8_0) x32.quantize(x, tokens, hidden, levels);
  if (any_q8_K) x256.quantize(x, tokens, hidden, levels);

  std::vector<float> sum(static_cast<size_t>(tokens * hidden), 0.0f);
  std::vector<float> gate_up, h, y;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = by_expert.start[e + 1] - by_expert.start[e];
    if (count == 0) continue;
    const int64_t* pairs = by_expert.order.data() + by_expert.start[e];
    gate_up.resize(static_cast<size_t>(count * 2 * inter));  // per token: gate's inter values, then up's
    project(gate, e, pairs, count, k, x32, x256, gate_up.data(), 2 * inter);
    if (up) project(*up, e, pairs, count, k, x32, x256, gate_up.data() + inter, 2 * inter);
    h.resize(static_cast<size_t>(count * inter));
    for (int64_t i = 0; i < count; ++i)
      for (int64_t j = 0; j < inter; ++j) {
        const float g = gate_up[i * 2 * inter + j];
        h[i * inter + j] = g / (1.0f + std::exp(-g)) * gate_up[i * 2 * inter + inter + j];
      }
    y.resize(static_cast<size_t>(count * hidden));
    if (takes_q8_K(down.type)) {
      down_project<ActQ8_K>(down, e, h, count, inter, levels, y.data());
    } else {
      down_project<ActQ8_0>(down, e, h, count, inter, levels, y.data());
    }
    for (int64_t i = 0; i < count; ++i) {
      const float w = weights[pairs[i]];
      float* s = sum.data() + pairs[i] / k * hidden;
      const float* yi = y.data() + i * hidden;
      for (int64_t j = 0; j < hidden; ++j) s[j] += w * yi[j];
    }
  }
  for (int64_t i = 0; i < tokens * hidden; ++i) out[i] = from_float<T>(sum[i]);
}

}  // namespace
}  // namespace ggml

// x [T, H] (float32, bfloat16, float16; contiguous), ids [T, k] int64 and weights [T, k] float32: each token's
// experts and their router weights. gate and up: [E, I, row_bytes] of their ggml types, or (up None) gate holds
// gate then up rows, [E, 2 I, row_bytes], of gate_type; down: [E, H, row_bytes] of down_type. Each expert's rows
// grouped by `group` (1, or 8 where I is a multiple of 8: see Layout). -> out [T, H] in x's dtype.
at::Tensor ggml_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& gate,
                    int64_t gate_type, const std::optional<at::Tensor>& up, int64_t up_type, const at::Tensor& down,
                    int64_t down_type, int64_t group, int64_t act_levels) {
  using namespace ggml;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "ggml_moe: x must be a contiguous [tokens, hidden] CPU matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "ggml_moe: x must be float32, bfloat16 or float16");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.is_contiguous() &&
                  ids.size(0) == tokens && ids.size(1) > 0,
              "ggml_moe: ids must be a contiguous int64 [tokens, k] CPU tensor with x's ", tokens, " rows");
  TORCH_CHECK(weights.device().is_cpu() && weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                  weights.sizes() == ids.sizes(),
              "ggml_moe: weights must be a contiguous float32 CPU tensor shaped as ids [", tokens, ", ", ids.size(1),
              "]");
  TORCH_CHECK(group == 1 || group == kDecodeGroup, "ggml_moe: rows are grouped by 1 or ", kDecodeGroup, ", not ",
              group);
  TORCH_CHECK(act_levels == 1 || act_levels == 2, "ggml_moe: act_levels must be 1 or 2, not ", act_levels);
  TORCH_CHECK(gate.dim() == 3, "ggml_moe: gate must be 3-D [experts, rows, row_bytes]");
  const int64_t experts = gate.size(0);
  const ExpertWeights gate_w = checked_experts(gate, up ? "gate" : "gate_up", gate_type, experts, hidden, group);
  const int64_t inter = up ? gate_w.rows : gate_w.rows / 2;
  TORCH_CHECK(up || (gate_w.rows % 2 == 0 && inter % group == 0), "ggml_moe: gate_up (gate and up rows) has ",
              gate_w.rows, " rows per expert; it needs twice a multiple of the group (", group, ")");
  ExpertWeights up_w{};
  if (up) {
    up_w = checked_experts(*up, "up", up_type, experts, hidden, group);
    TORCH_CHECK(up_w.rows == inter, "ggml_moe: up has ", up_w.rows, " rows per expert, gate ", inter);
  }
  const ExpertWeights down_w = checked_experts(down, "down", down_type, experts, inter, group);
  TORCH_CHECK(down_w.rows == hidden, "ggml_moe: down has ", down_w.rows, " rows per expert, x ", hidden, " columns");
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  if (tokens == 0) return out;
  QS_GGML_DISPATCH_DTYPES(x.scalar_type(), "ggml_moe", [&] {
    moe_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), tokens, hidden, ids.data_ptr<int64_t>(),
                       weights.data_ptr<float>(), ids.size(1), experts, gate_w, up ? &up_w : nullptr, down_w, inter,
                       act_levels);
  });
  return out;
}

}  // namespace qwenserve::cpu

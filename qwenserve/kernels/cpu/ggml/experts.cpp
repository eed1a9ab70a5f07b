// A mixture-of-experts layer's experts straight on their ggml blocks (ggml_moe): each expert a SiLU-gated MLP,
// down(silu(gate x) * up x), and each token's output the sum of its k chosen experts' outputs weighted by the router.
//
// One call per layer: the activations are quantized once, for each activation block the gate and up types take
// (q8_0 for the 32-blocks, q8_K for the K-quants); the (token, slot) pairs are grouped by expert with a counting sort
// (stable: an expert sees its tokens in order); and each expert that has tokens gathers its tokens' quantized rows,
// runs gate and up through mm_quantized (drivers.h: the decode-group kernels at one token, the tile kernels from a
// few), forms h = silu(gate) * up in float, quantizes h for the down type, runs down, and adds weight * result to its
// tokens' rows of a float32 sum, which is rounded once to out's dtype at the end. Only the chosen experts' bytes
// are read. Experts with many tokens run one after another, each matmul splitting its weight rows over the threads as
// ggml_mm does, so the threads share every expert's work however unevenly the tokens fall on the experts. Experts with
// fewer than kDecodeGroupRows rows (every expert of a decode step, most of a batched one) run together: all their gate
// and up matmuls in one parallel region, then all their downs in another, their weight rows handed out in chunks.

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

// One matmul of an expert: quantized activation rows (of the kind its type takes: the other pointer is null)
// against one expert's weights, into float rows ldo apart
struct Matmul {
  int64_t type;
  const std::vector<ActQ8_0>* rows_q8_0;
  const std::vector<ActQ8_K>* rows_q8_K;
  int64_t M, nb, levels;
  Layout w;
  int64_t N;
  float* out;
  int64_t ldo;
};

template <typename Kernel>
const std::vector<typename Kernel::Act>& rows_of(const Matmul& m) {
  if constexpr (std::is_same_v<typename Kernel::Act, ActQ8_0>) {
    TORCH_CHECK(m.rows_q8_0, "ggml_moe: ggml type ", m.type, " reached the wrong activation blocks");  // checked before
    return *m.rows_q8_0;
  } else {
    TORCH_CHECK(m.rows_q8_K, "ggml_moe: ggml type ", m.type, " reached the wrong activation blocks");
    return *m.rows_q8_K;
  }
}

// The whole matmul, by whichever kernel suits its rows (its own parallel region)
void run_alone(const Matmul& m) {
  with_kernel(m.type, [&](auto* kernel) {
    using Kernel = std::remove_pointer_t<decltype(kernel)>;
    mm_quantized<Kernel>(m.out, m.ldo, m.levels, rows_of<Kernel>(m), m.M, m.nb, m.w, m.N, nullptr);
  });
}

#if QS_X86_AVX2 || QS_ARM_NEON
constexpr bool kRunsTogether = true;

// Matmuls of fewer than kDecodeGroupRows rows on weights in the decode layout, all in one parallel region: their
// groups of weight rows handed to the threads in chunks as they ask. A decode step's k experts are small matmuls
// (an A3B expert's gate_up is 1.8 MB); one region each left a thread waiting at the end of every one of them.
void run_together(const std::vector<Matmul>& matmuls) {
  struct Chunk {
    size_t matmul;
    int64_t g0, g1;
  };
  const int64_t threads = at::get_num_threads();
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < matmuls.size(); ++i) {
    // a matmul in `threads` chunks: the many matmuls keep the threads busy to the end, and a chunk this long is a
    // stream the hardware prefetchers keep ahead of (an eighth of it, as mm_quantized cuts, is not)
    const int64_t groups = matmuls[i].N / kDecodeGroup, chunk = std::max<int64_t>(2, groups / threads);
    for (int64_t g = 0; g < groups; g += chunk) chunks.push_back({i, g, std::min(groups, g + chunk)});
  }
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (size_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks.size();) {
      const Matmul& m = matmuls[chunks[c].matmul];
      with_kernel(m.type, [&](auto* kernel) {
        using Kernel = std::remove_pointer_t<decltype(kernel)>;
        decode_groups<Kernel>(m.out, m.ldo, m.levels, rows_of<Kernel>(m).data(), m.M, m.nb, m.w, chunks[c].g0,
                              chunks[c].g1, nullptr);
      });
    }
  });
}
#else
constexpr bool kRunsTogether = false;  // no decode-group kernels in this build
void run_together(const std::vector<Matmul>& matmuls) {
  for (const Matmul& m : matmuls) run_alone(m);
}
#endif

// One expert's work in a call: its tokens' rows quantized, gate and up's outputs, h = silu(gate) * up quantized
// for down, and down's output
struct ExpertRun {
  int64_t expert, count;
  const int64_t* pairs;  // its (token, slot) pairs
  std::vector<ActQ8_0> x_q8_0, h_q8_0;
  std::vector<ActQ8_K> x_q8_K, h_q8_K;
  std::vector<float> gate_up, h, y;  // per token: gate's inter values then up's; h [count, inter]; y [count, hidden]
};

// The layer's three projections and the call's quantized tokens
struct MoeLayer {
  const ExpertWeights& gate;
  const ExpertWeights* up;  // null: gate holds gate then up rows
  const ExpertWeights& down;
  int64_t hidden, inter, k, levels;
  QuantizedTokens<ActQ8_0> x_q8_0;
  QuantizedTokens<ActQ8_K> x_q8_K;

  ExpertRun start(int64_t expert, const int64_t* pairs, int64_t count) const {
    ExpertRun r{expert, count, pairs};
    if (!x_q8_0.rows.empty()) r.x_q8_0 = x_q8_0.gather(pairs, count, k);
    if (!x_q8_K.rows.empty()) r.x_q8_K = x_q8_K.gather(pairs, count, k);
    r.gate_up.resize(static_cast<size_t>(count * 2 * inter));
    return r;
  }

  // Whether an expert's matmuls for `count` tokens take the decode-group kernels (and so can run together)
  bool few_rows(int64_t count) const { return levels * count < kDecodeGroupRows && gate.group == kDecodeGroup; }

  Matmul projection(ExpertRun& r, const ExpertWeights& w, int64_t column) const {
    const bool q8_K = takes_q8_K(w.type);
    return {w.type, q8_K ? nullptr : &r.x_q8_0, q8_K ? &r.x_q8_K : nullptr, levels * r.count,
            q8_K ? x_q8_K.nb : x_q8_0.nb, levels, w.of(r.expert), w.rows, r.gate_up.data() + column, 2 * inter};
  }

  void add_gate_up(ExpertRun& r, std::vector<Matmul>& matmuls) const {
    matmuls.push_back(projection(r, gate, 0));
    if (up) matmuls.push_back(projection(r, *up, inter));
  }

  // h = silu(gate) * up, quantized for down's type; then down's matmul
  Matmul activated_down(ExpertRun& r) const {
    r.h.resize(static_cast<size_t>(r.count * inter));
    for (int64_t i = 0; i < r.count; ++i)
      for (int64_t j = 0; j < inter; ++j) {
        const float g = r.gate_up[i * 2 * inter + j];
        r.h[i * inter + j] = g / (1.0f + std::exp(-g)) * r.gate_up[i * 2 * inter + inter + j];
      }
    r.y.resize(static_cast<size_t>(r.count * hidden));
    const bool q8_K = takes_q8_K(down.type);
    const int64_t nb = inter / (q8_K ? 256 : 32), rows = activation_rows_allocated(levels * r.count) * nb;
    if (q8_K) {
      r.h_q8_K.resize(static_cast<size_t>(rows));
      quantize_rows(r.h.data(), r.count, inter, levels, r.h_q8_K.data());
    } else {
      r.h_q8_0.resize(static_cast<size_t>(rows));
      quantize_rows(r.h.data(), r.count, inter, levels, r.h_q8_0.data());
    }
    return {down.type, q8_K ? nullptr : &r.h_q8_0, q8_K ? &r.h_q8_K : nullptr, levels * r.count, nb, levels,
            down.of(r.expert), down.rows, r.y.data(), hidden};
  }

  // sum[token] += router weight * y, for each of the run's tokens
  void add_weighted(const ExpertRun& r, const float* weights, float* sum) const {
    for (int64_t i = 0; i < r.count; ++i) {
      const float w = weights[r.pairs[i]];
      float* s = sum + r.pairs[i] / k * hidden;
      const float* yi = r.y.data() + i * hidden;
      for (int64_t j = 0; j < hidden; ++j) s[j] += w * yi[j];
    }
  }
};

// gate: [experts, inter, ...], or gate then up rows [experts, 2 inter, ...] where up is null. Experts with many
// tokens run one after another, each matmul spread over the threads; those with few (a decode step's) run together.
template <typename T>
void moe_impl(T* out, const T* x, int64_t tokens, int64_t hidden, const int64_t* ids, const float* weights,
              int64_t k, int64_t experts, const ExpertWeights& gate, const ExpertWeights* up,
              const ExpertWeights& down, int64_t inter, int64_t levels) {
  const PairsByExpert by_expert = group_by_expert(ids, tokens * k, k, experts);
  MoeLayer layer{gate, up, down, hidden, inter, k, levels};
  const bool any_q8_K = takes_q8_K(gate.type) || (up && takes_q8_K(up->type));
  const bool any_q8_0 = !takes_q8_K(gate.type) || (up && !takes_q8_K(up->type));
  if (any_q8_0) layer.x_q8_0.quantize(x, tokens, hidden, levels);
  if (any_q8_K) layer.x_q8_K.quantize(x, tokens, hidden, levels);

  // the experts with few tokens first, together; then every expert's share added in expert order, the others
  // run as their turn comes
  std::vector<ExpertRun> few;
  std::vector<int64_t> few_index(static_cast<size_t>(experts), -1);
  for (int64_t e = 0; e < experts && kRunsTogether; ++e) {
    const int64_t count = by_expert.start[e + 1] - by_expert.start[e];
    if (count == 0 || !layer.few_rows(count)) continue;
    few_index[e] = static_cast<int64_t>(few.size());
    few.push_back(layer.start(e, by_expert.order.data() + by_expert.start[e], count));
  }
  std::vector<Matmul> matmuls;  // few's buffers stay put from here on
  for (ExpertRun& r : few) layer.add_gate_up(r, matmuls);
  if (!matmuls.empty()) run_together(matmuls);
  matmuls.clear();
  for (ExpertRun& r : few) matmuls.push_back(layer.activated_down(r));
  if (!matmuls.empty()) run_together(matmuls);

  std::vector<float> sum(static_cast<size_t>(tokens * hidden), 0.0f);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = by_expert.start[e + 1] - by_expert.start[e];
    if (count == 0) continue;
    if (few_index[e] >= 0) {
      layer.add_weighted(few[few_index[e]], weights, sum.data());
      continue;
    }
    ExpertRun r = layer.start(e, by_expert.order.data() + by_expert.start[e], count);
    matmuls.clear();
    layer.add_gate_up(r, matmuls);
    for (const Matmul& m : matmuls) run_alone(m);
    run_alone(layer.activated_down(r));
    layer.add_weighted(r, weights, sum.data());
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

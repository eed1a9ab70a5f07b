// DecodeLayers (decode_layers.cpp): a pipeline stage's decoder layers for decode-only batches, bound as a torch
// custom class by register.cpp. Declared here so that file can bind its methods.
#pragma once

#include <torch/custom_class.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace qwenserve::cpu {
// torch finds a custom class by its C++ type, and type names compare by their text: an inline namespace named after
// the variant keeps each variant's class a type of its own when several variants load in one process (the tests)
inline namespace QS_OPS_NAMESPACE {

class DecodeLayers : public torch::CustomClassHolder {
 public:
  // the projections of a layer, in the order add_segment numbers them: a dense MLP's gate_up and down, or (a
  // mixture-of-experts layer) its shared expert's
  static constexpr int64_t kProjections = 6;  // qkv, o, gate_up, down, shared expert gate_up, shared expert down

  DecodeLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, int64_t act_levels,
               at::Tensor cos_sin);
  // the next layer: its two norm weights and its KV cache tensors [blocks, block_size, kv_heads, head_dim]
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor k_cache, at::Tensor v_cache);
  // the last layer's per-head RMSNorm weights [head_dim] for its queries and keys (Qwen3), applied after the qkv
  // projection and before the rotary embedding; a layer without them has none
  void add_head_norms(at::Tensor q_norm, at::Tensor k_norm);
  // the last layer's MLP is a mixture of experts (moe.py's SparseMoeBlock with its experts as blocks): the router
  // weight [experts, hidden] and its top k (renormalised where `renormalize`), then ggml_moe's arguments for the
  // stacked experts (gate, or gate then up where up is None; down; their ggml types; the rows' group; act_levels)
  void add_experts(at::Tensor router, int64_t top_k, bool renormalize, at::Tensor gate, int64_t gate_type,
                   std::optional<at::Tensor> up, int64_t up_type, at::Tensor down, int64_t down_type, int64_t group,
                   int64_t act_levels);
  // the last layer's experts have a shared expert (Qwen2-MoE): its sigmoid gate's weight [1, hidden]; its gate_up
  // and down projections come as segments of projections 4 and 5
  void add_shared_expert(at::Tensor gate_weight);
  // one ggml_mm call of the last layer's projection: its rows [offset, offset + rows) of out_features outputs
  void add_segment(int64_t projection, int64_t out_features, at::Tensor raw, int64_t ggml_type, int64_t group,
                   std::optional<at::Tensor> bias, int64_t offset, int64_t rows);
  // the last layer's projection as one fp8_mm call: e4m3 codes [out_features, in] as uint8 and float32 scales
  // [out_features, groups] per row and group of `group` input columns (quantization/fp8.py's layout)
  void add_fp8_projection(int64_t projection, at::Tensor codes, at::Tensor scales, int64_t group,
                          std::optional<at::Tensor> bias);
  // hidden [B, H] (and the residual, None on the first stage) -> (hidden, residual) after the last layer, as the
  // layer modules return them; positions, slots: [B] int64; block_tables [B, width], context_lens [B] int64
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, std::optional<at::Tensor> residual, at::Tensor positions,
                                         at::Tensor slots, at::Tensor block_tables, at::Tensor context_lens) const;
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Segment {
    at::Tensor raw;  // ggml blocks, or FP8 codes where fp8_scales is defined
    int64_t ggml_type, group;
    std::optional<at::Tensor> bias;
    int64_t offset, rows;
    at::Tensor fp8_scales;
  };
  struct Projection {
    std::vector<Segment> segments;
    int64_t out_features = 0;
  };
  struct Experts {
    at::Tensor router;
    int64_t top_k;
    bool renormalize;
    at::Tensor gate;
    int64_t gate_type;
    std::optional<at::Tensor> up;
    int64_t up_type;
    at::Tensor down;
    int64_t down_type, group, act_levels;
    at::Tensor shared_gate;  // undefined where there is no shared expert
  };
  struct Layer {
    at::Tensor input_norm, post_norm;
    at::Tensor q_norm, k_norm;  // undefined where the layer has no per-head norms
    std::array<Projection, kProjections> projections;
    at::Tensor k_cache, v_cache;
    std::optional<Experts> experts;  // a mixture-of-experts MLP in place of the dense one
  };

  Projection& projection_for(const char* method, int64_t projection, int64_t out_features);
  void project(at::Tensor& out, const at::Tensor& x, const Projection& p) const;
  void write_kv(const Layer& layer, const at::Tensor& qkv, const at::Tensor& slots) const;
  at::Tensor mlp(const at::Tensor& x, const Projection& gate_up, const Projection& down) const;
  at::Tensor run_experts(const Layer& layer, const at::Tensor& x) const;
  void norm_heads(at::Tensor& qkv, int64_t first_head, int64_t heads, const at::Tensor& weight) const;

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t act_levels_;
  at::Tensor cos_sin_;
  std::vector<Layer> layers_;
};

}  // namespace QS_OPS_NAMESPACE
}  // namespace qwenserve::cpu

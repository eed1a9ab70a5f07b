// A decode-only batch through a pipeline stage's decoder layers in one call (DecodeLayers): the CPU's stand-in for
// a captured graph. It calls the same kernels in the same order as the layer modules do one by one (norms, the
// projections' ggml_mm segments or an FP8 projection's fp8_mm, the per-head q/k norms where the layer has them,
// rotary, the KV write, paged decode attention, SiLU), so its results are bit-identical to theirs; what it removes
// is the Python between the calls, which at batch 1 on a small model is a sixth of a step (docs/performance.md,
// "Decode layers in one call").
// Mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE with their experts as ggml blocks) run here too: the router as
// moe.py's TopKRouter computes it (the same ATen ops: linear, softmax in float32, topk, renormalisation), the
// experts by the ggml_moe kernel the module calls, and Qwen2-MoE's shared expert by its ggml_mm segments, SiLU and
// its sigmoid gate, added as SparseMoeBlock adds it.
// Built once per model and KV cache by model/layers/decode_layers.py, which also decides when a step may take it.

#include "decode_layers.h"

#include <cstring>

#include "ops.h"

namespace qwenserve::cpu {

DecodeLayers::DecodeLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
                           int64_t act_levels, at::Tensor cos_sin)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale), act_levels_(act_levels),
      cos_sin_(std::move(cos_sin)) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
              "DecodeLayers: heads must be a multiple of kv_heads and head_dim even");
}

void DecodeLayers::add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor k_cache, at::Tensor v_cache) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == kv_heads_ && k_cache.size(3) == head_dim_,
              "DecodeLayers.add_layer: caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == input_norm.scalar_type(),
              "DecodeLayers.add_layer: the cache must hold the activations' dtype (no int8 / fp8 codes)");
  layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), {}, {}, {}, std::move(k_cache),
                          std::move(v_cache)});
}

void DecodeLayers::add_head_norms(at::Tensor q_norm, at::Tensor k_norm) {
  TORCH_CHECK(!layers_.empty(), "DecodeLayers.add_head_norms: add the layer first");
  TORCH_CHECK(q_norm.dim() == 1 && q_norm.size(0) == head_dim_ && k_norm.dim() == 1 && k_norm.size(0) == head_dim_,
              "DecodeLayers.add_head_norms: the weights must be [head_dim]");
  layers_.back().q_norm = std::move(q_norm);
  layers_.back().k_norm = std::move(k_norm);
}

void DecodeLayers::add_experts(at::Tensor router, int64_t top_k, bool renormalize, at::Tensor gate,
                               int64_t gate_type, std::optional<at::Tensor> up, int64_t up_type, at::Tensor down,
                               int64_t down_type, int64_t group, int64_t act_levels) {
  TORCH_CHECK(!layers_.empty(), "DecodeLayers.add_experts: add the layer first");
  TORCH_CHECK(router.dim() == 2 && router.size(1) == layers_.back().input_norm.size(0),
              "DecodeLayers.add_experts: the router weight must be [experts, hidden]");
  TORCH_CHECK(gate.dim() == 3 && gate.size(0) == router.size(0) && down.dim() == 3 && down.size(0) == router.size(0),
              "DecodeLayers.add_experts: gate and down must stack the router's ", router.size(0), " experts");
  TORCH_CHECK(top_k >= 1 && top_k <= router.size(0), "DecodeLayers.add_experts: top_k ", top_k, " outside 1..",
              router.size(0));
  layers_.back().experts = Experts{std::move(router), top_k, renormalize, std::move(gate), gate_type, std::move(up),
                                   up_type, std::move(down), down_type, group, act_levels, at::Tensor()};
}

void DecodeLayers::add_shared_expert(at::Tensor gate_weight) {
  TORCH_CHECK(!layers_.empty() && layers_.back().experts.has_value(),
              "DecodeLayers.add_shared_expert: add the layer's experts first");
  TORCH_CHECK(gate_weight.dim() == 2 && gate_weight.size(0) == 1 &&
                  gate_weight.size(1) == layers_.back().input_norm.size(0),
              "DecodeLayers.add_shared_expert: the gate weight must be [1, hidden]");
  layers_.back().experts->shared_gate = std::move(gate_weight);
}

DecodeLayers::Projection& DecodeLayers::projection_for(const char* method, int64_t projection,
                                                       int64_t out_features) {
  TORCH_CHECK(!layers_.empty(), "DecodeLayers.", method, ": add the layer first");
  TORCH_CHECK(projection >= 0 && projection < kProjections, "DecodeLayers.", method, ": projection ", projection,
              " is not 0 (qkv), 1 (o), 2 (gate_up), 3 (down), 4 (shared expert gate_up) or 5 (shared expert down)");
  Projection& p = layers_.back().projections[projection];
  TORCH_CHECK(p.out_features == 0 || p.out_features == out_features,
              "DecodeLayers.", method, ": segments of one projection disagree on its outputs");
  p.out_features = out_features;
  return p;
}

void DecodeLayers::add_segment(int64_t projection, int64_t out_features, at::Tensor raw, int64_t ggml_type,
                               int64_t group, std::optional<at::Tensor> bias, int64_t offset, int64_t rows) {
  TORCH_CHECK(offset >= 0 && rows > 0 && offset + rows <= out_features,
              "DecodeLayers.add_segment: rows [", offset, ", ", offset + rows, ") outside ", out_features, " outputs");
  projection_for("add_segment", projection, out_features)
      .segments.push_back(Segment{std::move(raw), ggml_type, group, std::move(bias), offset, rows, at::Tensor()});
}

void DecodeLayers::add_fp8_projection(int64_t projection, at::Tensor codes, at::Tensor scales, int64_t group,
                                      std::optional<at::Tensor> bias) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && scales.dim() == 2 &&
                  scales.size(0) == codes.size(0) && scales.scalar_type() == at::kFloat,
              "DecodeLayers.add_fp8_projection: codes must be uint8 [out, in] and scales float32 [out, groups]");
  const int64_t out_features = codes.size(0);
  Projection& p = projection_for("add_fp8_projection", projection, out_features);
  TORCH_CHECK(p.segments.empty(), "DecodeLayers.add_fp8_projection: the projection already has segments");
  p.segments.push_back(Segment{std::move(codes), -1, group, std::move(bias), 0, out_features, std::move(scales)});
}

// out[B, out_features] = x @ W^T (+ bias): one ggml_mm per segment, as GGMLBlockLinearMethod.apply does at few
// rows, or the one fp8_mm of an FP8 projection, as fp8_linear does
void DecodeLayers::project(at::Tensor& out, const at::Tensor& x, const Projection& p) const {
  for (const Segment& s : p.segments) {
    at::Tensor target = s.rows == p.out_features ? out : out.narrow(1, s.offset, s.rows);
    if (s.fp8_scales.defined())
      fp8_mm(target, x, s.raw, s.fp8_scales, s.group, s.bias);
    else
      ggml_mm(target, x, s.raw, s.ggml_type, s.group, s.bias, act_levels_);
  }
}

// down(silu_and_mul(gate_up(x))), as Qwen2MLP runs it at few rows
at::Tensor DecodeLayers::mlp(const at::Tensor& x, const Projection& gate_up, const Projection& down) const {
  const int64_t rows = x.size(0);
  TORCH_CHECK(!gate_up.segments.empty() && !down.segments.empty(), "DecodeLayers.run: a layer's MLP has no segments");
  at::Tensor up = at::empty({rows, gate_up.out_features}, x.options());
  project(up, x, gate_up);
  at::Tensor act = at::empty({rows, gate_up.out_features / 2}, x.options());
  silu_and_mul(act, up);
  at::Tensor out = at::empty({rows, down.out_features}, x.options());
  project(out, act, down);
  return out;
}

// SparseMoeBlock.forward at one tensor-parallel rank: TopKRouter's weights and ids by the same ATen ops (the logits in
// x's dtype, softmax in float32, topk, renormalised where asked, cast to x's dtype), then ggml_moe with the weights
// in float32 as ExpertBlocks.run passes them; the shared expert, where there is one, scaled by the sigmoid of its
// gate and added
at::Tensor DecodeLayers::run_experts(const Layer& layer, const at::Tensor& x) const {
  const Experts& e = *layer.experts;
  at::Tensor probs = at::softmax(at::linear(x, e.router), -1, at::kFloat);
  auto [weights, ids] = at::topk(probs, e.top_k, -1);
  if (e.renormalize) weights = weights / weights.sum(-1, true);
  weights = weights.to(x.scalar_type());
  at::Tensor out = ggml_moe(x, ids.contiguous(), weights.to(at::kFloat).contiguous(), e.gate, e.gate_type, e.up,
                            e.up_type, e.down, e.down_type, e.group, e.act_levels);
  if (e.shared_gate.defined()) {
    at::Tensor shared = mlp(x, layer.projections[4], layer.projections[5]);
    out = out + at::sigmoid(at::linear(x, e.shared_gate)) * shared;
  }
  return out;
}

// RMSNorm over each of `heads` heads from head first_head of the fused projection's rows, in place: the rows are
// gathered into a contiguous [B * heads, head_dim] tensor for the same rms_norm kernel the module path calls on its
// reshaped copy, so the results are the same bits
void DecodeLayers::norm_heads(at::Tensor& qkv, int64_t first_head, int64_t heads, const at::Tensor& weight) const {
  const int64_t rows = qkv.size(0);
  at::Tensor part = qkv.narrow(1, first_head * head_dim_, heads * head_dim_);
  at::Tensor x = part.reshape({rows * heads, head_dim_}).contiguous();
  at::Tensor normed = at::empty_like(x);
  rms_norm(normed, x, weight, eps_);
  part.copy_(normed.view({rows, heads * head_dim_}));
}

// This step's k and v rows of the fused projection's output into their cache slots (index_copy_ on the module path)
void DecodeLayers::write_kv(const Layer& layer, const at::Tensor& qkv, const at::Tensor& slots) const {
  const int64_t rows = qkv.size(0), kv = kv_heads_ * head_dim_, q = heads_ * head_dim_;
  const int64_t bytes = kv * qkv.element_size(), slot_count = layer.k_cache.size(0) * layer.k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const char* base = static_cast<const char*>(qkv.data_ptr());
  char* k = static_cast<char*>(layer.k_cache.data_ptr());
  char* v = static_cast<char*>(layer.v_cache.data_ptr());
  const int64_t row_bytes = qkv.stride(0) * qkv.element_size(), elem = qkv.element_size();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < slot_count, "DecodeLayers: slot ", slot[r], " outside the cache");
    std::memcpy(k + slot[r] * bytes, base + r * row_bytes + q * elem, bytes);
    std::memcpy(v + slot[r] * bytes, base + r * row_bytes + (q + kv) * elem, bytes);
  }
}

std::tuple<at::Tensor, at::Tensor> DecodeLayers::run(at::Tensor hidden, std::optional<at::Tensor> residual,
                                                     at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                                                     at::Tensor context_lens) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "DecodeLayers.run: hidden must be a contiguous [B, H]");
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows,
              "DecodeLayers.run: slots must be int64, one per row");
  const int64_t q_size = heads_ * head_dim_;
  at::Tensor res = residual.has_value() ? *residual : at::Tensor();
  at::Tensor attn = at::empty({rows, heads_, head_dim_}, hidden.options());
  for (const Layer& layer : layers_) {
    const Projection& qkv_p = layer.projections[0];
    const Projection& o_p = layer.projections[1];
    if (!res.defined()) {  // the first layer of the first stage: the embedding is the residual
      res = hidden;
      hidden = at::empty_like(res);
      rms_norm(hidden, res, layer.input_norm, eps_);
    } else {
      fused_add_rms_norm(hidden, res, layer.input_norm, eps_);
    }
    at::Tensor qkv = at::empty({rows, qkv_p.out_features}, hidden.options());
    project(qkv, hidden, qkv_p);
    if (layer.q_norm.defined()) {
      norm_heads(qkv, 0, heads_, layer.q_norm);
      norm_heads(qkv, heads_, kv_heads_, layer.k_norm);
    }
    rotary_embedding(qkv, positions, cos_sin_, heads_ + kv_heads_, head_dim_);
    write_kv(layer, qkv, slots);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, heads_, head_dim_});
    paged_decode_attention(attn, q, layer.k_cache, layer.v_cache, block_tables, context_lens, scale_, std::nullopt,
                           std::nullopt);
    at::Tensor attended = at::empty({rows, o_p.out_features}, hidden.options());
    project(attended, attn.view({rows, q_size}), o_p);
    fused_add_rms_norm(attended, res, layer.post_norm, eps_);
    hidden = layer.experts ? run_experts(layer, attended)
                           : mlp(attended, layer.projections[2], layer.projections[3]);
  }
  return {hidden, res};
}

}  // namespace qwenserve::cpu

// Registers the fused CPU kernels for the decoder layer as torch.ops.<QS_OPS_NAMESPACE>.*, and the DecodeLayers class
// as torch.classes.<QS_OPS_NAMESPACE>.DecodeLayers. Each replaces a chain
// of small PyTorch ops (and their temporaries) with one pass over the data. The schemas and the CPU bindings live
// here only: TORCH_LIBRARY may appear once per library, and keeping the bindings next to it shows every op at a
// glance. Every .cpp under cpu/ is built once per CPU variant (qwenserve/config/cpu_variants.py), each library
// with its own namespace (qwenserve_avx2, qwenserve_avx512_vnni, ...), so several variants load in one process.

#include <torch/library.h>

#include "decode_layers.h"
#include "ops.h"

#ifndef QS_OPS_NAMESPACE
#error "QS_OPS_NAMESPACE (the torch.ops namespace of this variant's library) must be defined by the build"
#endif

// one level of indirection, so the namespace macro expands before TORCH_LIBRARY pastes and stringifies it
#define QS_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define QS_TORCH_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

QS_TORCH_LIBRARY(QS_OPS_NAMESPACE, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, int heads, int head_dim) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor row_slots) -> ()");
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, Tensor? k_scales=None, Tensor? v_scales=None) -> ()");
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale) -> ()");
  m.def("prefill_attention_paged(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int context_len, float scale) -> ()");
  m.def("prefill_attention_supported(int head_dim) -> bool", &qwenserve::cpu::prefill_attention_supported);
  m.def("ggml_dequantize(Tensor raw, int ggml_type, int cols, ScalarType dtype, int group=1) -> Tensor");
  m.def("ggml_mm(Tensor(a!) out, Tensor x, Tensor raw, int ggml_type, int group=1, Tensor? bias=None, "
        "int act_levels=1) -> ()");
  m.def("ggml_mm_tiles(int ggml_type) -> bool", &qwenserve::cpu::ggml_mm_tiles);  // no tensor: no dispatch key
  m.def("ggml_amx_tiles() -> bool", &qwenserve::cpu::ggml_amx_tiles);
  m.def("ggml_amx_bf16_tiles() -> bool", &qwenserve::cpu::ggml_amx_bf16_tiles);
  m.def("ggml_allow_amx(bool allow) -> ()", &qwenserve::cpu::ggml_allow_amx);
  m.def("ggml_moe(Tensor x, Tensor ids, Tensor weights, Tensor gate, int gate_type, Tensor? up, int up_type, "
        "Tensor down, int down_type, int group=1, int act_levels=1) -> Tensor");
  m.def("dense_mm(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias=None) -> ()");
  m.def("fp8_mm(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, int group, Tensor? bias=None) -> ()");
  m.def("fp8_dequantize(Tensor(a!) out, Tensor codes, Tensor scales, int group) -> ()");
  m.def("fp8_tiles() -> bool", &qwenserve::cpu::fp8_tiles);
  m.def("int8_roof(int threads=0, float seconds=0.2, bool amx=False) -> (float, float, str)",
        &qwenserve::cpu::int8_roof);
  using qwenserve::cpu::DecodeLayers;
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, int64_t, at::Tensor>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_head_norms", &DecodeLayers::add_head_norms)
      .def("add_experts", &DecodeLayers::add_experts)
      .def("add_shared_expert", &DecodeLayers::add_shared_expert)
      .def("add_segment", &DecodeLayers::add_segment)
      .def("add_fp8_projection", &DecodeLayers::add_fp8_projection)
      .def("run", &DecodeLayers::run)
      .def("num_layers", &DecodeLayers::num_layers);
}

QS_TORCH_LIBRARY_IMPL(QS_OPS_NAMESPACE, CPU, m) {
  m.impl("rms_norm", &qwenserve::cpu::rms_norm);
  m.impl("fused_add_rms_norm", &qwenserve::cpu::fused_add_rms_norm);
  m.impl("rotary_embedding", &qwenserve::cpu::rotary_embedding);
  m.impl("silu_and_mul", &qwenserve::cpu::silu_and_mul);
  m.impl("paged_decode_attention", &qwenserve::cpu::paged_decode_attention);
  m.impl("argmax_rows", &qwenserve::cpu::argmax_rows);
  m.impl("lora_add", &qwenserve::cpu::lora_add);
  m.impl("prefill_attention", &qwenserve::cpu::prefill_attention);
  m.impl("prefill_attention_paged", &qwenserve::cpu::prefill_attention_paged);
  m.impl("ggml_dequantize", &qwenserve::cpu::ggml_dequantize);
  m.impl("ggml_mm", &qwenserve::cpu::ggml_mm);
  m.impl("ggml_moe", &qwenserve::cpu::ggml_moe);
  m.impl("dense_mm", &qwenserve::cpu::dense_mm);
  m.impl("fp8_mm", &qwenserve::cpu::fp8_mm);
  m.impl("fp8_dequantize", &qwenserve::cpu::fp8_dequantize);
}

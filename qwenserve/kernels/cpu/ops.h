// The op entry points, one definition each in the op family's source file (norm.cpp, rotary.cpp,
// activation.cpp, attention.cpp, prefill_attention.cpp, sampling.cpp, lora.cpp, ggml/dispatch.cpp,
// ggml/experts.cpp, dense.cpp, roof.cpp), declared here so register.cpp can bind them to the schemas of the variant's torch.ops namespace
// in one place. Each checks its arguments and dispatches on the dtype (float32, float64, bfloat16, float16; the ggml
// ops: float32, bfloat16, float16; prefill_attention: bf16 only); the shapes each expects are documented at its
// definition.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace qwenserve::cpu {

// norm.cpp
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
// rotary.cpp
void rotary_embedding(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t heads,
                      int64_t head_dim);
// activation.cpp
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
// attention.cpp
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales);
// prefill_attention.cpp (bf16, causal; supported: AVX512-BF16 and head_dim 64 or 128): a prompt without cached
// context from its own k / v, or a chunk after cached context from the paged cache
void prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
void prefill_attention_paged(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table, int64_t context_len,
                             double scale);
bool prefill_attention_supported(int64_t head_dim);
// sampling.cpp
at::Tensor argmax_rows(const at::Tensor& logits);
// lora.cpp: the stacked LoRA products of a decode-sized step
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& row_slots);
// ggml/dispatch.cpp (ggml types: Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)
at::Tensor ggml_dequantize(const at::Tensor& raw, int64_t ggml_type, int64_t cols, at::ScalarType dtype,
                           int64_t group);
// act_levels: 1 quantizes each activation once to int8 blocks, as llama.cpp; 2 quantizes what that leaves too
void ggml_mm(at::Tensor& out, const at::Tensor& x, const at::Tensor& raw, int64_t ggml_type, int64_t group,
             const std::optional<at::Tensor>& bias, int64_t act_levels);
// whether ggml_mm has a tile kernel for this type (weights in the decode layout, many activation rows): the
// AVX512-VNNI one, or the 256-bit one of AVX2 builds (Q8_0 there only with 256-bit VNNI)
bool ggml_mm_tiles(int64_t ggml_type);
// whether ggml_mm runs the AMX int8 tile kernel (the K-quants, from 32 activation rows), and a switch that keeps it off
bool ggml_amx_tiles();
// whether ggml_mm runs the AMX bf16 tile kernel (the 32-blocks in bf16 runs, from 32 activation rows); the switch
// keeps both off
bool ggml_amx_bf16_tiles();
void ggml_allow_amx(bool allow);
// ggml/experts.cpp: a mixture-of-experts layer's chosen experts on their blocks, activations quantized as ggml_mm's;
// up None: gate holds each expert's gate then up rows
at::Tensor ggml_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& gate,
                    int64_t gate_type, const std::optional<at::Tensor>& up, int64_t up_type, const at::Tensor& down,
                    int64_t down_type, int64_t group, int64_t act_levels);
// dense.cpp: out = x w^T + bias on bf16 / fp16 weights widened in registers (CPUs without bf16 arithmetic)
void dense_mm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
// dense.cpp: the same on FP8 e4m3 codes with float32 scales per row and group of input columns, and those weights
// widened to out's dtype (prefill's matmuls on slices)
void fp8_mm(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group,
            const std::optional<at::Tensor>& bias);
void fp8_dequantize(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales, int64_t group);
// whether fp8_mm runs many bf16 activation rows on tiles of its own (AVX512-BF16 builds); elsewhere the caller widens
// slices for dense matmuls
bool fp8_tiles();
// roof.cpp: GOP/s (2 per int8 MAC) of a register-only loop of this build's int8 tile instructions on one thread and
// on `threads` threads (0: all of torch's), and their name; amx: the AMX tile multiplies instead (where allowed)
std::tuple<double, double, std::string> int8_roof(int64_t threads, double seconds, bool amx);

}  // namespace qwenserve::cpu

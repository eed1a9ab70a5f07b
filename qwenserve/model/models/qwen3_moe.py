"""Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k
norms, an explicit head_dim) and Qwen2-MoE's sparse layers without a shared expert, the top-k router weights
renormalised by default (norm_topk_prob, see Qwen3MoeDecoderLayer). GGUF files of it (general.architecture
qwen3moe) load as Qwen2-MoE's do (qwen2_moe.py), with the head width as qwen3moe.attention.key_length."""
from __future__ import annotations

from qwenserve.model.models.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM
from qwenserve.model.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer
from qwenserve.model.registry import MODEL_REGISTRY


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_class = Qwen3Attention
    decode_parts = Qwen3DecoderLayer.decode_parts
    # where config.json lacks norm_topk_prob: true, as every published Qwen3-MoE config.json says and as llama.cpp
    # runs qwen3moe GGUF files (transformers' Qwen3MoeConfig itself defaults to false)
    norm_topk_prob_default = True
    has_shared_expert = False


@MODEL_REGISTRY.register("Qwen3MoeForCausalLM", gguf_architecture="qwen3moe")
class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    layer_class = Qwen3MoeDecoderLayer

"""Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k
norms, an explicit head_dim) and Qwen2-MoE's sparse layers without a shared expert, the top-k router weights
renormalised by default (norm_topk_prob). HF safetensors only so far: GGUF files of the family (qwen3moe) are not
registered."""
from __future__ import annotations

from qwenserve.model.models.qwen2 import Qwen2ForCausalLM
from qwenserve.model.models.qwen2_moe import Qwen2MoeDecoderLayer
from qwenserve.model.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer
from qwenserve.model.registry import MODEL_REGISTRY


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_class = Qwen3Attention
    decode_parts = Qwen3DecoderLayer.decode_parts
    norm_topk_prob_default = True  # transformers' Qwen3MoeConfig
    has_shared_expert = False


@MODEL_REGISTRY.register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen2ForCausalLM):
    layer_class = Qwen3MoeDecoderLayer

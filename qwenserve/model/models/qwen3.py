"""Qwen3ForCausalLM (Qwen3 0.6B-32B, dense): Qwen2's decoder with an RMSNorm over each query and key head before
the rotary embedding (q_norm, k_norm), no attention biases unless config.json's attention_bias asks for them, and a
head_dim that config.json gives (128 in every published size, where hidden / heads is 64 in the 0.6B). GGUF files
of it carry general.architecture "qwen3", the head width as qwen3.attention.key_length and the norms as
blk.N.attn_q_norm / attn_k_norm."""
from __future__ import annotations

import torch

from qwenserve.model.layers.layernorm import RMSNorm
from qwenserve.model.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM
from qwenserve.model.registry import MODEL_REGISTRY


class Qwen3Attention(Qwen2Attention):
    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        """attention_bias (default false) gives q/k/v and o_proj their biases together, as transformers' Qwen3."""
        return bool(config.attention_bias), bool(config.attention_bias)

    def __init__(self, config, layer_idx, max_position, tp, linear_method):
        super().__init__(config, layer_idx, max_position, tp, linear_method)
        # one weight per head width, shared by every head (so every tensor-parallel rank holds all of it)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_qkv(self, hidden: torch.Tensor, lora) -> torch.Tensor:
        qkv = self.qkv_proj(hidden, lora)
        t, d = qkv.shape[0], self.head_dim
        q_size, k_size = self.num_heads * d, self.num_kv_heads * d
        # normed in place: the projection's output is this step's own, and v stays where it is
        qkv[:, :q_size] = self.q_norm(qkv[:, :q_size].reshape(t * self.num_heads, d)).view(t, q_size)
        qkv[:, q_size:q_size + k_size] = self.k_norm(
            qkv[:, q_size:q_size + k_size].reshape(t * self.num_kv_heads, d)).view(t, k_size)
        return qkv


class Qwen3DecoderLayer(Qwen2DecoderLayer):
    attention_class = Qwen3Attention
    decode_parts = Qwen2DecoderLayer.decode_parts[:2] + ("self_attn.q_norm", "self_attn.k_norm") + \
        Qwen2DecoderLayer.decode_parts[2:]


@MODEL_REGISTRY.register("Qwen3ForCausalLM", gguf_architecture="qwen3")
class Qwen3ForCausalLM(Qwen2ForCausalLM):
    layer_class = Qwen3DecoderLayer

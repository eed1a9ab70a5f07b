"""Qwen2ForCausalLM in vLLM's form: flat token batches, fused projections, tensor-parallel layers.

forward(input_ids [T], positions [T], attn_metadata) -> hidden states [T, hidden]; compute_logits(hidden) for the
positions that need them. The model knows nothing of requests: the caller decides which rows get logits.

Under pipeline parallelism a stage builds only its own layers (the others are parameterless placeholders, so
checkpoint names keep their layer numbers): the embedding on the first stage, the final norm and the LM head on
the last. A stage that is not the first takes (hidden, residual) from the previous one; one that is not the
last returns them instead of hidden states.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from qwenserve.config.model_config import ModelConfig
from qwenserve.config.tuning import this_cpu_tuning
from qwenserve.distributed.layout import check_head_split
from qwenserve.distributed.pipeline import PipelineParallel
from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.kernels import cpu_ops_for, fused_decode_allowed
from qwenserve.model.interface import KVCacheSpec
from qwenserve.model.layers.activation import SiluAndMul
from qwenserve.model.layers.attention import Attention, AttentionMetadata
from qwenserve.model.layers.decode_layers import FusedDecodeLayers
from qwenserve.model.layers.dual_chunk_attention import DualChunkAttention, DualChunkRotaryEmbedding
from qwenserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from qwenserve.model.layers.layernorm import RMSNorm
from qwenserve.model.layers.linear import LinearMethod, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from qwenserve.model.layers.quantization import QuantizationScheme
from qwenserve.model.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from qwenserve.model.registry import MODEL_REGISTRY

logger = logging.getLogger(__name__)


class Qwen2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, max_position: int, tp: TensorParallel,
                 linear_method: LinearMethod | None):
        """layer_idx: this layer's index in the stage's KV cache."""
        super().__init__()
        head_dim = config.head_dim
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, tp=tp,
                                          linear_method=linear_method)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias, tp=tp,
                                        linear_method=linear_method)
        scale = head_dim ** -0.5
        kv_heads = (config.num_key_value_heads, self.qkv_proj.first_kv_head)  # per-head KV cache scales' slice
        if config.dual_chunk is not None:  # dual-chunk attention: its remapped rotary and its attention
            self.rotary_emb = DualChunkRotaryEmbedding(head_dim, config.rope_theta, config.dual_chunk)
            self.attn = DualChunkAttention(layer_idx, self.num_heads, self.num_kv_heads, head_dim, scale,
                                           config.dual_chunk, kv_heads)
            return
        if config.mrope_section is None:
            self.rotary_emb = RotaryEmbedding(head_dim, max_position, config.rope_theta,
                                              config.max_position_embeddings, config.rope_scaling)
        else:  # a vision-language model's positions are [3, T] (temporal, height, width)
            self.rotary_emb = MRotaryEmbedding(head_dim, max_position, config.rope_theta,
                                               config.max_position_embeddings, config.rope_scaling,
                                               config.mrope_section)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, head_dim, scale=scale, kv_heads=kv_heads)

    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        """(q/k/v biases, o_proj bias): Qwen2 has the first (unless config.json's attention_bias says otherwise)
        and never the second."""
        return config.attention_bias is not False, False

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        lora = attn_metadata.lora
        q, k, v = self.rotary_emb.rotate_qkv(positions, self.project_qkv(hidden, lora), self.num_heads,
                                             self.num_kv_heads)
        return self.o_proj(self.attn(q, k, v, attn_metadata), lora)

    def project_qkv(self, hidden: torch.Tensor, lora) -> torch.Tensor:
        """[T, hidden] -> the fused q, k, v rows [T, (heads + 2 kv_heads) * head_dim] that the rotary takes."""
        return self.qkv_proj(hidden, lora)


class Qwen2MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, linear_method: LinearMethod | None,
                 intermediate_size: int | None = None):
        """intermediate_size: the MLP's width where it is not config.intermediate_size (a shared expert's)."""
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.rows_per_pass = this_cpu_tuning().mlp_rows_per_pass
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, tp=tp,
                                                       linear_method=linear_method)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp=tp, linear_method=linear_method)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """lora: the step's adapter batch (AttentionMetadata.lora), or None."""
        if x.shape[0] > self.rows_per_pass:
            # large prompt batches in slices: the [rows, 2 * intermediate] activation then stays in cache
            # (docs/tuning.md, "MLP rows per pass")
            n = self.rows_per_pass
            return torch.cat([self._mlp(part, lora and lora.narrow(i * n, len(part)))
                              for i, part in enumerate(x.split(n))])
        return self._mlp(x, lora)

    def _mlp(self, x: torch.Tensor, lora) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x, lora)), lora)


class Qwen2DecoderLayer(nn.Module):
    attention_class = Qwen2Attention
    # what the layer computes, in order, by module: the fused decode call (model/layers/decode_layers.py) runs a
    # layer only if it runs every part named here, and every parameter of the layer lies in one of them
    decode_parts = ("input_layernorm", "self_attn.qkv_proj", "self_attn.rotary_emb", "self_attn.attn",
                    "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn",
                    "mlp.down_proj")

    def __init__(self, config: ModelConfig, layer_idx: int, max_position: int, tp: TensorParallel,
                 linear_method: LinearMethod | None, layer_number: int = 0):
        """layer_idx: the layer's index in its stage's KV cache; layer_number: its index in the whole model."""
        super().__init__()
        if config.dual_chunk is not None:
            # a part DecodeLayers does not run (its one rotary table and attention kernel are ordinary
            # attention's), so this layer's decode steps run through the modules
            self.decode_parts = tuple("self_attn.dual_chunk_attention" if part == "self_attn.attn" else part
                                      for part in type(self).decode_parts)
        self.self_attn = self.attention_class(config, layer_idx, max_position, tp, linear_method)
        self.mlp = self.make_mlp(config, layer_number, tp, linear_method)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config: ModelConfig, layer_number: int, tp: TensorParallel,
                 linear_method: LinearMethod | None) -> nn.Module:
        """The layer's MLP (a mixture-of-experts family returns its sparse block on the layers that have one)."""
        return Qwen2MLP(config, tp, linear_method)

    def forward(self, positions, hidden, residual, attn_metadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, attn_metadata.lora), residual


class MissingLayer(nn.Module):
    """Where another pipeline stage owns the layer: no parameters, never called."""


def layer_cost(config: ModelConfig) -> tuple[float, float]:
    """(cost of one decoder layer, cost of the LM head) in weights read, to balance pipeline stages. The head runs
    only on the rows that sample, so it counts at a share of its weights (docs/tuning.md, "Head cost share")."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    head_share = this_cpu_tuning().head_cost_share
    return h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size, head_share * config.vocab_size * h


class Qwen2Model(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int, tp: TensorParallel, linear_method: LinearMethod | None,
                 embedding_blocks: bool = False, pp: PipelineParallel = PipelineParallel(),
                 layer_class: type[Qwen2DecoderLayer] = Qwen2DecoderLayer):
        super().__init__()
        self.pp = pp
        self.start_layer, self.end_layer = pp.layer_range(config.num_hidden_layers, *layer_cost(config))
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, embedding_blocks)
                             if pp.is_first else None)
        self.layers = nn.ModuleList(
            layer_class(config, i - self.start_layer, max_position, tp, linear_method, layer_number=i)
            if self.start_layer <= i < self.end_layer else MissingLayer() for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None
        # a plain list, made once: slicing the ModuleList in forward would build a new ModuleList every step
        self.own_layers: list[Qwen2DecoderLayer] = list(self.layers)[self.start_layer:self.end_layer]
        ops = cpu_ops_for(torch.empty(0).device) if fused_decode_allowed() else None
        self.fused_decode = FusedDecodeLayers(self.own_layers, ops)

    def forward(self, input_ids, positions, attn_metadata, intermediate=None, inputs_embeds=None):
        """inputs_embeds: the first stage's input rows when they are not all token embeddings (images spliced
        in); None: embed input_ids."""
        if self.pp.is_first:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden, residual = intermediate
        fused = self.fused_decode.call_for(attn_metadata, positions.shape[-1])
        if fused is not None:
            group = attn_metadata.decode[0]
            hidden, residual = fused.run(hidden, residual, positions, attn_metadata.slot_mapping, group.block_tables,
                                         group.context_lens)
        else:
            for layer in self.own_layers:
                hidden, residual = layer(positions, hidden, residual, attn_metadata)
        if not self.pp.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


@MODEL_REGISTRY.register("Qwen2ForCausalLM", gguf_architecture="qwen2")
class Qwen2ForCausalLM(nn.Module):
    layer_class = Qwen2DecoderLayer
    # checkpoint projection -> (fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_position: int, tp: TensorParallel = TensorParallel(),
                 quantization: QuantizationScheme = QuantizationScheme(), pp: PipelineParallel = PipelineParallel()):
        """quantization: how the linear layers and the LM head hold and apply their weights (default: dense)."""
        super().__init__()
        check_head_split(config.num_attention_heads, config.num_key_value_heads, tp.size)
        self.config = config
        self.pp = pp
        self.hidden_size = config.hidden_size
        self.dtype = torch.get_default_dtype()  # parameters are created in it (see model_loader)
        self.model = Qwen2Model(config, max_position, tp, quantization.layers, quantization.embedding_blocks, pp,
                                self.layer_class)
        self.lm_head = None
        if pp.is_last:
            # a tied head computes on the embedding's blocks where the embedding keeps them, else on its dense
            # weight (an HF checkpoint's embedding is dense, whatever the layers' quantization)
            tied_dense = config.tie_word_embeddings and not quantization.embedding_blocks
            head_method = None if tied_dense else quantization.lm_head
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, head_method)
            if config.tie_word_embeddings and pp.is_first:
                self.lm_head.tie_to(self.model.embed_tokens)
        if tp.size > 1 or pp.size > 1:
            attn = self.model.own_layers[0].self_attn
            logger.info("tensor-parallel rank %d of %d: %d query heads, %d kv heads; pipeline stage %d of %d: "
                        "layers %d-%d", tp.rank, tp.size, attn.num_heads, attn.num_kv_heads, pp.rank, pp.size,
                        self.model.start_layer, self.model.end_layer - 1)

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.model.own_layers[0].self_attn
        return KVCacheSpec(len(self.model.own_layers), attn.num_kv_heads, attn.head_dim, self.dtype)

    def checkpoint_target(self, name: str) -> str | None:
        """The parameter name a checkpoint tensor loads into, or None when another pipeline stage owns it. A
        tied head on a last stage without the embedding loads its own copy of the embedding's weight. A layer
        past the model's last is no stage's: its name comes back as it is, which no parameter has (the loader
        refuses it)."""
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            owned_elsewhere = index < self.config.num_hidden_layers and not (
                self.model.start_layer <= index < self.model.end_layer)
            return None if owned_elsewhere else name
        if name.startswith("model.embed_tokens."):
            if self.model.embed_tokens is not None:
                return name
            tied_head_here = self.lm_head is not None and self.config.tie_word_embeddings
            return name.replace("model.embed_tokens.", "lm_head.") if tied_head_here else None
        if name.startswith("model.norm."):
            return name if self.pp.is_last else None
        if name.startswith("lm_head."):
            return name if self.pp.is_last and not self.config.tie_word_embeddings else None
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Hidden states on the last stage; (hidden, residual) for the next stage on the others."""
        return self.model(input_ids, positions, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def process_weights_after_loading(self, after_each: Callable[[], None] = lambda: None) -> None:
        """Let each linear method re-arrange its loaded weights (e.g. oneDNN packing in bf16 on the CPU)."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
                after_each()

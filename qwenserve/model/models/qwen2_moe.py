"""Qwen2MoeForCausalLM (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention, and on the sparse layers a
mixture-of-experts MLP (model/layers/moe.py) beside a shared expert whose output a sigmoid gate scales. A layer is
sparse where config.json's decoder_sparse_step divides its number plus one and mlp_only_layers does not list it;
the others keep a dense MLP of intermediate_size.

The family's own config fields (num_experts, num_experts_per_tok, moe_intermediate_size,
shared_expert_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers) are read and checked here
from config.json (ModelConfig keeps them in `extra`).

GGUF files (general.architecture qwen2moe, as llama.cpp's convert_hf_to_gguf writes them) give the same fields
through `gguf_config_fields`, from llama.cpp's keys ({arch}.expert_count, expert_used_count,
expert_feed_forward_length, expert_shared_feed_forward_length) and from the tensors present: a layer is sparse
where it has a router (blk.N.ffn_gate_inp), the shared expert exists where blk.N.ffn_gate_inp_shexp does.
llama.cpp's own files have every layer sparse and, for qwen2moe, a shared expert; it renormalises the top-k for
qwen3moe and not for qwen2moe (no key says so), as transformers' defaults do; {arch}.expert_weights_norm, where a
file has it, overrides that. The experts' 3-D tensors (blk.N.ffn_{gate,up,down}_exps, [experts, rows, row
length]) load one expert at a time (the loader, GGUFCheckpoint): under the `gguf` quantization, where our CPU kernels
run, they stay as the file's blocks and run on them (model/layers/moe.py); otherwise they are dequantized to the run
dtype."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import ModelConfig
from qwenserve.model.layers.moe import FusedExperts, TopKRouter
from qwenserve.model.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2MLP
from qwenserve.model.registry import MODEL_REGISTRY


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    @classmethod
    def from_config(cls, config: ModelConfig, norm_topk_prob_default: bool, shared_expert: bool) -> "MoEConfig":
        """From config.json's fields (ModelConfig.extra), each checked, with transformers' defaults. The expert
        count is num_experts as published, or num_local_experts as transformers 5 writes Qwen3-MoE's."""
        extra = dict(config.extra)
        if "num_experts" not in extra and "num_local_experts" in extra:
            extra["num_experts"] = extra["num_local_experts"]
        missing = [k for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
                   + (("shared_expert_intermediate_size",) if shared_expert else ()) if k not in extra]
        if missing:
            raise ConfigError(f"config.json of a mixture-of-experts model lacks field(s) {', '.join(missing)}")
        mlp_only_layers = extra.get("mlp_only_layers")
        if mlp_only_layers is not None and not isinstance(mlp_only_layers, (list, tuple)):
            raise ConfigError(f"config field mlp_only_layers must be a list of layer numbers, got {mlp_only_layers!r}")
        out = cls(num_experts=extra["num_experts"], top_k=extra["num_experts_per_tok"],
                  intermediate_size=extra["moe_intermediate_size"],
                  norm_topk_prob=extra.get("norm_topk_prob", norm_topk_prob_default),
                  decoder_sparse_step=extra.get("decoder_sparse_step", 1),
                  mlp_only_layers=tuple(mlp_only_layers or ()),
                  shared_expert_intermediate_size=extra.get("shared_expert_intermediate_size", 0)
                  if shared_expert else 0)
        for name in ("num_experts", "top_k", "intermediate_size", "decoder_sparse_step"):
            value = getattr(out, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                field = {"top_k": "num_experts_per_tok", "intermediate_size": "moe_intermediate_size"}.get(name, name)
                raise ConfigError(f"config field {field} must be a positive integer, got {value!r}")
        if out.top_k > out.num_experts:
            raise ConfigError(f"config field num_experts_per_tok ({out.top_k}) is more than num_experts "
                              f"({out.num_experts})")
        if not isinstance(out.norm_topk_prob, bool):
            raise ConfigError(f"config field norm_topk_prob must be true or false, got {out.norm_topk_prob!r}")
        bad = [i for i in out.mlp_only_layers
               if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < config.num_hidden_layers]
        if bad:
            raise ConfigError(f"config field mlp_only_layers holds {bad}, not layer numbers (0 to "
                              f"{config.num_hidden_layers - 1})")
        if shared_expert and (not isinstance(out.shared_expert_intermediate_size, int)
                              or out.shared_expert_intermediate_size < 0):
            raise ConfigError("config field shared_expert_intermediate_size must be a non-negative integer, got "
                              f"{out.shared_expert_intermediate_size!r}")
        return out

    def is_sparse(self, layer_number: int) -> bool:
        """transformers' rule: a layer has experts unless mlp_only_layers lists it, every decoder_sparse_step."""
        return layer_number not in self.mlp_only_layers and (layer_number + 1) % self.decoder_sparse_step == 0


def _load_gate_vector(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """The shared expert's gate [1, hidden] from HF's [1, hidden] or GGUF's vector [hidden]."""
    if loaded.numel() != param.numel() or loaded.dim() > 2:
        raise ValueError(f"shared expert gate of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded.reshape(param.shape))


class SparseMoeBlock(nn.Module):
    """The router (`gate`), the experts and, for Qwen2-MoE, the shared expert and its gate."""

    def __init__(self, config: ModelConfig, moe: MoEConfig, tp, linear_method):
        super().__init__()
        self.gate = TopKRouter(config.hidden_size, moe.num_experts, moe.top_k, moe.norm_topk_prob)
        self.experts = FusedExperts(moe.num_experts, config.hidden_size, moe.intermediate_size, tp, linear_method)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = Qwen2MLP(config, tp, linear_method, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
            self.shared_expert_gate.weight.requires_grad_(False)
            self.shared_expert_gate.weight.weight_loader = _load_gate_vector

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, lora)
        return out


class Qwen2MoeAttention(Qwen2Attention):
    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        """q/k/v biases as config.json's qkv_bias says (transformers 5 writes it; true by default), no o_proj bias."""
        return bool(config.extra.get("qkv_bias", True)), False


class Qwen2MoeDecoderLayer(Qwen2DecoderLayer):
    attention_class = Qwen2MoeAttention
    norm_topk_prob_default = False  # transformers' Qwen2MoeConfig
    has_shared_expert = True

    def make_mlp(self, config, layer_number, tp, linear_method) -> nn.Module:
        moe = MoEConfig.from_config(config, self.norm_topk_prob_default, self.has_shared_expert)
        if not moe.is_sparse(layer_number):
            return Qwen2MLP(config, tp, linear_method)
        # the one-call decode (model/layers/decode_layers.py) runs the router and the experts where they are blocks,
        # and the shared expert's MLP and gate, in place of the dense MLP's parts
        self.decode_parts = self.decode_parts[:self.decode_parts.index("mlp.gate_up_proj")] + ("mlp.gate",
                                                                                              "mlp.experts")
        if moe.shared_expert_intermediate_size:
            self.decode_parts += ("mlp.shared_expert.gate_up_proj", "mlp.shared_expert.act_fn",
                                  "mlp.shared_expert.down_proj", "mlp.shared_expert_gate")
        return SparseMoeBlock(config, moe, tp, linear_method)


# a shared expert's tensors in a GGUF file: its gate, up and down projections and the gate that scales it
_GGUF_SHARED_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down|gate_inp)_shexp\.weight$")


def _gguf_positive(md: dict, key: str) -> int:
    value = md.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"GGUF metadata {key} must be a positive integer, got {value!r}"
                          + (" (missing)" if value is None else ""))
    return value


@MODEL_REGISTRY.register("Qwen2MoeForCausalLM", gguf_architecture="qwen2moe")
class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    layer_class = Qwen2MoeDecoderLayer
    # llama.cpp's names for the sparse layers' tensors (gguf's MODEL_TENSOR.FFN_GATE_INP, FFN_*_EXP, FFN_*_SHEXP,
    # FFN_GATE_INP_SHEXP); "{expert}": the tensor stacks every expert of the layer
    gguf_layer_names = {
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.{expert}.gate_proj", "ffn_up_exps": "mlp.experts.{expert}.up_proj",
        "ffn_down_exps": "mlp.experts.{expert}.down_proj",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    }

    @classmethod
    def gguf_config_fields(cls, md: dict, arch: str, tensor_names: frozenset[str]) -> dict:
        """config.json's MoE fields from a GGUF file's metadata and tensor names (module docstring); MoEConfig
        checks them as it checks config.json's when the model is built."""
        layers = _gguf_positive(md, f"{arch}.block_count")
        experts, used = _gguf_positive(md, f"{arch}.expert_count"), _gguf_positive(md, f"{arch}.expert_used_count")
        dense_width = md.get(f"{arch}.feed_forward_length")
        # llama.cpp's fallbacks where a width key is absent: the dense width over the experts used; the dense width
        expert_width = md.get(f"{arch}.expert_feed_forward_length") or (dense_width or 0) // used
        if used > experts:
            raise ConfigError(f"GGUF metadata {arch}.expert_used_count ({used}) is more than {arch}.expert_count "
                              f"({experts})")
        sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names]
        if not sparse:
            raise ConfigError(f"GGUF file of architecture {arch} has no router tensor (blk.N.ffn_gate_inp.weight) "
                              "in any layer: it is not a mixture-of-experts file")
        cls._check_shared_expert_tensors(arch, tensor_names)
        shared = cls.layer_class.has_shared_expert and any(
            f"blk.{i}.ffn_gate_inp_shexp.weight" in tensor_names for i in sparse)
        return {
            "num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": expert_width,
            "shared_expert_intermediate_size": (md.get(f"{arch}.expert_shared_feed_forward_length") or dense_width)
            if shared else 0,
            "norm_topk_prob": bool(md.get(f"{arch}.expert_weights_norm", cls.layer_class.norm_topk_prob_default)),
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(layers) if i not in sparse],
            "qkv_bias": "blk.0.attn_q.bias" in tensor_names,
        }

    @classmethod
    def _check_shared_expert_tensors(cls, arch: str, tensor_names: frozenset[str]) -> None:
        """Refuse shared-expert tensors the model would drop: any, in a family without a shared expert; a
        layer's gate/up/down without the gate that scales them (the model has a shared expert only where
        blk.N.ffn_gate_inp_shexp is)."""
        found = sorted(n for n in tensor_names if _GGUF_SHARED_EXPERT.match(n))
        if found and not cls.layer_class.has_shared_expert:
            raise ConfigError(f"GGUF tensor {found[0]} belongs to a shared expert, but {cls.__name__} ({arch}) has "
                              f"no shared expert: the file's {len(found)} shared-expert tensors are unexpected")
        for layer in sorted({int(name.split(".")[1]) for name in found}):
            gate = f"blk.{layer}.ffn_gate_inp_shexp.weight"
            if gate not in tensor_names:
                parts = [p for p in ("gate", "up", "down") if f"blk.{layer}.ffn_{p}_shexp.weight" in tensor_names]
                raise ConfigError(f"GGUF layer {layer} has its shared expert's {'/'.join(parts)} tensors "
                                  f"(blk.{layer}.ffn_{{{','.join(parts)}}}_shexp.weight) but not the shared "
                                  f"expert's gate tensor {gate}, which scales its output")

    @classmethod
    def expert_layers(cls, config: ModelConfig) -> list[int]:
        """The layers built sparse (experts and a router, no dense MLP): what LoRA checks adapters against."""
        layer = cls.layer_class
        moe = MoEConfig.from_config(config, layer.norm_topk_prob_default, layer.has_shared_expert)
        return [i for i in range(config.num_hidden_layers) if moe.is_sparse(i)]

    def checkpoint_target(self, name: str) -> str | None:
        # transformers writes a shared expert of width 0 (and its gate) where shared_expert_intermediate_size is 0:
        # it adds nothing, and this model has none to load it into (check_dropped refuses one that is not empty)
        if ".mlp.shared_expert" in name and not self.config.extra.get("shared_expert_intermediate_size"):
            return None
        return super().checkpoint_target(name)

    def check_dropped(self, name: str, tensor) -> None:
        """Raise where a checkpoint tensor this model drops holds weights: a shared expert of some width where
        config.json says it has none (its gate alone scales nothing, and is dropped whatever its shape)."""
        if (".mlp.shared_expert." in name and not self.config.extra.get("shared_expert_intermediate_size")
                and math.prod(tensor.shape)):
            if not self.layer_class.has_shared_expert:
                raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, but {type(self).__name__} "
                                 "has no shared expert: the tensor is unexpected")
            raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, but config field "
                             "shared_expert_intermediate_size is 0: the model has no shared expert to load it into")

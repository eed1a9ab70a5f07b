"""PEFT LoRA adapters as PEFT writes them (`save_pretrained`): adapter_config.json and adapter_model.safetensors
(or .bin), read and checked against the base model before any request runs with them.

What is served: `r`, `lora_alpha` and `use_rslora` (scaling alpha / r, or alpha / sqrt(r)) on q/k/v/o and
gate/up/down projections of the decoder layers; in a mixture-of-experts model the attention projections of every
layer and the MLP projections of its dense layers only (a sparse layer has experts and a router where a dense MLP
would be). Everything else PEFT can write (DoRA, LoRA biases, full copies of `modules_to_save`, per-module ranks,
other target modules, experts' parameters) is an error naming the field or tensor, never skipped: an adapter run
without a part of it would answer wrongly and silently.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from qwenserve.config.model_config import ModelConfig
from qwenserve.model.registry import MODEL_REGISTRY

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# the projections an adapter may target, and the decoder-layer block each sits in
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# adapter_config.json fields of PEFT variants that compute something else than plain LoRA
_FORWARD_CHANGING = ("use_qalora", "alora_invocation_tokens", "trainable_token_indices", "arrow_config")
EXPERTS_NOT_SUPPORTED = ("LoRA on a mixture-of-experts layer's experts is not supported (adapters of the attention "
                         "projections and of dense layers are)")
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served as written; the message names the adapter, and the field or tensor."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """What PEFT multiplies B A x by."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class Adapter:
    """An adapter's weights, checked: (layer index, module name e.g. "q_proj") -> (A [r, in], B [out, r])."""
    config: AdapterConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def expert_layers(config: ModelConfig) -> frozenset[int]:
    """The decoder layers whose MLP is a mixture of experts (no gate/up/down projection there to adapt), by the
    model class's own rule (its optional classmethod `expert_layers`; none for a dense model)."""
    model_class = MODEL_REGISTRY.model_class(MODEL_REGISTRY.resolve(config.architectures))
    rule = getattr(model_class, "expert_layers", None)
    return frozenset() if rule is None else frozenset(rule(config))


def expert_layer_error(path: str, layer: int, module: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {path!r} adapts layer {layer}'s {module}, which is a mixture-of-experts "
                            f"layer's: {EXPERTS_NOT_SUPPORTED}")


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module in the whole (unsharded) Qwen2 model."""
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def read_config(path: str, max_lora_rank: int) -> AdapterConfig:
    """adapter_config.json, every field that changes the adapter's output checked."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: no such directory")
    if not os.path.isfile(file):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is missing (not a PEFT adapter directory)")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")

    def bad(field: str, why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} field {field!r} {why}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"is {cfg['peft_type']!r}; only LORA adapters are served")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad("r", f"must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise bad("r", f"is {r}, above max_lora_rank {max_lora_rank} (start the engine with a larger max_lora_rank)")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    if cfg.get("use_dora"):
        raise bad("use_dora", "is set: DoRA adapters are not supported")
    if cfg.get("modules_to_save"):
        raise bad("modules_to_save", f"is {cfg['modules_to_save']!r}: adapters that replace whole modules are not "
                                     f"supported")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", f"is {cfg['bias']!r}: adapters that train biases are not supported (only 'none')")
    if cfg.get("lora_bias"):
        raise bad("lora_bias", "is set: LoRA B biases are not supported")
    if cfg.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out", "is set: transposed (Conv1D) weights are not supported")
    if cfg.get("target_parameters"):  # what PEFT writes for fused experts: before the rank_pattern it adds with them
        raise bad("target_parameters", f"is {cfg['target_parameters']!r}: {EXPERTS_NOT_SUPPORTED}")
    for field in ("rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise bad(field, f"is {cfg[field]!r}: per-module ranks and alphas are not supported")
    if cfg.get("layer_replication"):
        raise bad("layer_replication", "is set: replicated layers are not supported")
    for field in _FORWARD_CHANGING:  # newer PEFT variants whose forward is not x + B A x * scaling
        if cfg.get(field):
            raise bad(field, f"is {cfg[field]!r}: not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):  # a string is a regex over module paths: the tensors say what it matched
        # names or full module paths (PEFT writes paths for "all-linear" on small models): the last part decides
        unknown = sorted({t for t in targets if not isinstance(t, str) or t.rpartition(".")[2] not in TARGET_MODULES},
                         key=str)
        if unknown:
            raise bad("target_modules", f"names {unknown}: only {', '.join(TARGET_MODULES)} can be adapted")
    return AdapterConfig(r, float(alpha), bool(cfg.get("use_rslora", False)))


def weights_file(path: str) -> str:
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise LoRAAdapterError(f"LoRA adapter {path!r}: no {' or '.join(WEIGHT_FILES)}")


def _unsupported_tensor(name: str) -> str:
    if "lora_magnitude_vector" in name:
        return "a DoRA magnitude (use_dora), not supported"
    if ".lora_A.bias" in name or ".lora_B.bias" in name:
        return "a LoRA bias (lora_bias), not supported"
    if "lora_embedding" in name:
        return "an embedding adapter, not supported"
    if ".lora_" not in name:
        return "a full weight (modules_to_save or a trained bias), not supported"
    if ".mlp.shared_expert." in name or ".mlp.experts." in name:
        part = "shared expert" if ".mlp.shared_expert." in name else "experts"
        return (f"a LoRA weight of a mixture-of-experts layer's {part}: LoRA on a mixture-of-experts layer's {part} "
                f"is not supported (adapters of the attention projections and of dense layers are)")
    return f"not a LoRA A/B weight of {'/'.join(TARGET_MODULES)} in a decoder layer"


def check_shapes(path: str, shapes: dict[str, tuple[int, ...]], config: AdapterConfig,
                 model: ModelConfig) -> dict[tuple[int, str], tuple[str, str]]:
    """Every tensor of the file (name -> shape) checked against the base model: (layer, module) -> (name of A,
    name of B)."""
    file = os.path.basename(weights_file(path))
    expected = projection_shapes(model)
    sparse = expert_layers(model)
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, shape in shapes.items():
        m = _TENSOR.match(name)
        if m is None or TARGET_MODULES.get(m.group(3)) != m.group(2):
            raise LoRAAdapterError(f"LoRA adapter {path!r}: {file} tensor {name!r} is {_unsupported_tensor(name)}")
        layer, module, kind = int(m.group(1)), m.group(3), m.group(4)
        if layer >= model.num_hidden_layers:
            raise LoRAAdapterError(f"LoRA adapter {path!r}: {file} tensor {name!r} is for layer {layer}; the base "
                                   f"model has {model.num_hidden_layers} layers")
        if layer in sparse and TARGET_MODULES[module] == "mlp":
            raise expert_layer_error(path, layer, module)
        in_features, out_features = expected[module]
        want = (config.rank, in_features) if kind == "A" else (out_features, config.rank)
        if tuple(shape) != want:
            raise LoRAAdapterError(f"LoRA adapter {path!r}: {file} tensor {name!r} has shape {tuple(shape)}; the "
                                   f"base model and r={config.rank} need {want}")
        found.setdefault((layer, module), {})[kind] = name
    if not found:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {file} holds no LoRA weights")
    for (layer, module), pair in found.items():
        if len(pair) == 1:
            (kind, name), = pair.items()
            raise LoRAAdapterError(f"LoRA adapter {path!r}: {file} tensor {name!r} has no lora_"
                                   f"{'B' if kind == 'A' else 'A'} beside it")
    return {key: (pair["A"], pair["B"]) for key, pair in found.items()}


def _read_tensors(file: str, shapes_only: bool):
    if file.endswith(".safetensors"):
        from safetensors import safe_open
        with safe_open(file, framework="pt") as f:
            if shapes_only:
                return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            return {name: f.get_tensor(name) for name in f.keys()}
    tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    return {name: tuple(t.shape) for name, t in tensors.items()} if shapes_only else tensors


def _readable(path: str, read):
    try:
        return read()
    except LoRAAdapterError:
        raise
    except Exception as e:  # noqa: BLE001 (a truncated or foreign file: name it, whatever the reader raised)
        raise LoRAAdapterError(f"LoRA adapter {path!r}: cannot read {os.path.basename(weights_file(path))}: "
                               f"{type(e).__name__}: {e}") from e


def check_adapter(path: str, model: ModelConfig, max_lora_rank: int) -> AdapterConfig:
    """Check an adapter fully without loading its weights (the safetensors header only): what the engine does
    before it queues a request that names it."""
    config = read_config(path, max_lora_rank)
    shapes = _readable(path, lambda: _read_tensors(weights_file(path), shapes_only=True))
    check_shapes(path, shapes, config, model)
    return config


def load_adapter(path: str, model: ModelConfig, max_lora_rank: int) -> Adapter:
    """An adapter's config and weights, checked as check_adapter does."""
    config = read_config(path, max_lora_rank)
    tensors = _readable(path, lambda: _read_tensors(weights_file(path), shapes_only=False))
    names = check_shapes(path, {name: tuple(t.shape) for name, t in tensors.items()}, config, model)
    return Adapter(config, {key: (tensors[a], tensors[b]) for key, (a, b) in names.items()})

"""Where a model comes from: an HF directory, a GGUF file, or (no --model) the bundled GGUF.

A checkpoint gives the model config, the weights as (HF parameter name, tensor) pairs, the tokenizer and
the generation defaults; everything downstream is the same whichever kind it is. The engine opens it by path
once, to resolve it (resolve.py); after that it is reopened from the ResolvedModel (the engine for its tokenizer,
each worker for its weights), without reading or checking its configuration again."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType

from qwenserve.config.dual_chunk_config import FIELD as DUAL_CHUNK_FIELD, merge_overrides
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import DEFAULT_ROPE_THETA, ModelConfig
from qwenserve.config.resolved_model import ResolvedModel
from qwenserve.model.loader import bundled
from qwenserve.model.loader.dequant import dequantize
from qwenserve.model.loader.ggml_tensor import GGMLTensor
from qwenserve.model.loader.gguf_file import GGUFFile
from qwenserve.model.loader.tokenizer import END_OF_TURN, load_hf_tokenizer, tokenizer_from_gguf
from qwenserve.model.registry import MODEL_REGISTRY

logger = logging.getLogger(__name__)
_FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


@dataclass
class Checkpoint:
    format = ""  # one of CHECKPOINT_FORMATS (config/resolved_model.py)
    path: str
    model_id: str
    config: ModelConfig
    naming: str  # how its tensors are named, for error messages
    generation_config: dict = field(default_factory=dict)

    preprocessor_config: dict = field(default_factory=dict)  # preprocessor_config.json, for image inputs
    # video_preprocessor_config.json, for video inputs; None: the file is absent (videos take preprocessor_config's)
    video_preprocessor_config: dict | None = None

    # how the checkpoint's weights are stored: "none" (dense) or the quantization they need ("gguf", ...)
    native_quantization = "none"
    quantization_config: dict = field(default_factory=dict)  # config.json's, for awq and gptq

    # where the config's num_hidden_layers comes from, for the loader's errors
    layer_count_key = "num_hidden_layers in config.json"

    @property
    def weight_files(self) -> tuple[str, ...]:
        raise NotImplementedError

    def weights(self, keep_types: frozenset = frozenset()) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
        """(HF name, tensor) for every weight; GGUF tensors of a type in keep_types come as their blocks (a layer's
        experts, where keep_types is not empty, of every quantized type: see GGUFCheckpoint)."""
        raise NotImplementedError

    def tokenizer(self):
        raise NotImplementedError

    def release_pages(self) -> None:
        """Let go of the memory the checkpoint's reading has taken so far, if any: called after each module has
        copied its weights into its own layout, and once the model holds them all."""


def open_checkpoint(model: str | None = None, hf_overrides: dict | None = None) -> Checkpoint:
    """hf_overrides: fields merged into config.json (a GGUF file's: into the config.json its metadata makes)
    before the config is read and checked."""
    if model is None:
        return GGUFCheckpoint(bundled.bundled_model_path(), model_id=bundled.MODEL_ID, hf_overrides=hf_overrides)
    if os.path.isdir(model):
        return HFCheckpoint(model, hf_overrides=hf_overrides)
    if os.path.isfile(model):
        if model.endswith(".gguf"):
            return GGUFCheckpoint(model, hf_overrides=hf_overrides)
        raise ValueError(f"--model {model} is a file but not a .gguf file; pass a GGUF file or an HF directory")
    raise ValueError(f"--model {model}: no such file or directory (qwenserve loads local checkpoints only: an HF "
                     "directory with config.json and *.safetensors, or a .gguf file)")


def reopen_checkpoint(resolved: ResolvedModel) -> Checkpoint:
    """The checkpoint an engine resolved, opened again for its weights or its tokenizer: its configuration is
    resolved's, not read or checked again."""
    if resolved.format == "gguf":
        return GGUFCheckpoint(resolved.path, resolved.model_id, resolved.config, resolved.model_class)
    return HFCheckpoint(resolved.path, resolved.model_id, resolved)


class HFCheckpoint(Checkpoint):
    format = "hf"
    NAMING = "HF names (model.layers.N.self_attn.q_proj.weight, ...) in *.safetensors"

    def __init__(self, path: str, model_id: str | None = None, resolved: ResolvedModel | None = None,
                 hf_overrides: dict | None = None):
        """resolved: what an engine made of this directory, whose configuration and file list are taken as
        they are; without it config.json (with hf_overrides merged in) is read and checked."""
        if resolved is not None:
            super().__init__(path, model_id or path, resolved.config, self.NAMING, resolved.generation_config)
            self.files = list(resolved.weight_files)
            self._set_quantization_config(resolved.quantization_config)
            self.preprocessor_config = resolved.preprocessor_config
            self.video_preprocessor_config = resolved.video_preprocessor_config
            return
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"{path} has no config.json, so it is not an HF checkpoint directory")
        with open(config_path) as f:
            raw_config = json.load(f)
        if hf_overrides:
            raw_config = merge_overrides(raw_config, hf_overrides)
        # Qwen's 1M checkpoints ship dual-chunk attention's sparse part beside config.json
        sparse_file = (raw_config.get(DUAL_CHUNK_FIELD) is not None
                       and os.path.isfile(os.path.join(path, "sparse_attention_config.json")))
        config = ModelConfig.from_hf_dict(raw_config, sparse_attention_file=sparse_file)
        gen_path = os.path.join(path, "generation_config.json")
        generation = json.load(open(gen_path)) if os.path.isfile(gen_path) else {}
        super().__init__(path, model_id or path, config, self.NAMING, generation)
        self.files = self._safetensors_files()
        self._set_quantization_config(raw_config.get("quantization_config") or {})
        self.preprocessor_config, self.video_preprocessor_config = _processor_configs(path)

    def _set_quantization_config(self, quantization_config: dict) -> None:
        self.quantization_config = quantization_config
        self.native_quantization = str(quantization_config.get("quant_method", "none")).lower()

    @property
    def weight_files(self) -> tuple[str, ...]:
        return tuple(self.files)

    def _safetensors_files(self) -> list[str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        else:
            names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not names:
            raise ValueError(f"{self.path} has no *.safetensors weights")
        missing = [n for n in names if not os.path.isfile(os.path.join(self.path, n))]
        if missing:
            raise ValueError(f"{self.path}: weight files listed in the index are missing: {', '.join(missing)}")
        return [os.path.join(self.path, n) for n in names]

    def weights(self, keep_types: frozenset = frozenset()):
        from safetensors import safe_open
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def tokenizer(self):
        return load_hf_tokenizer(self.path)


# GGUF tensor names (llama.cpp) -> HF names. A model class adds its own layer names as `gguf_layer_names`
# (model/interface.py); "{expert}" in one marks a 3-D tensor that holds every expert of the layer, one per index.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
EXPERT_INDEX = "{expert}"


_CONTROL_TOKEN = 3  # tokenizer.ggml.token_type of a control token


def _end_of_generation_ids(metadata: dict, eos_token_id: int | None) -> list[int]:
    """The file's EOS and EOT ids and those of END_OF_TURN that its vocabulary holds as control tokens, as llama.cpp's
    end-of-generation set has them: a GGUF file names one EOS, and a model that ends its answer with the other would
    otherwise run on past it (and min_tokens would not hold it back)."""
    ids = {i for i in (eos_token_id, metadata.get("tokenizer.ggml.eot_token_id")) if isinstance(i, int)}
    tokens, types = metadata.get("tokenizer.ggml.tokens") or [], metadata.get("tokenizer.ggml.token_type") or []
    for text in END_OF_TURN:
        if text in tokens:
            token_id = tokens.index(text)
            if token_id < len(types) and types[token_id] == _CONTROL_TOKEN:
                ids.add(token_id)
    return sorted(ids)


def gguf_to_hf_name(name: str, layer_names: dict[str, str] | None = None) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; unknown names are returned unchanged.
    layer_names: a model class's own layer names (gguf_layer_names), beside the common ones."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = _GGUF_LAYER_RE.match(name)
    names = {**_GGUF_LAYER_NAMES, **(layer_names or {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return name


def config_from_gguf(md: dict, tensor_names: frozenset[str] = frozenset()) -> ModelConfig:
    """The model config from GGUF metadata: llama.cpp's keys under the file's general.architecture (which must
    be registered, model/registry.py), e.g. qwen2.block_count. A model class with family fields of its own
    (`gguf_config_fields`, model/interface.py) turns the metadata and the file's tensor names into them
    (ModelConfig.extra)."""
    arch = md.get("general.architecture")
    architecture = MODEL_REGISTRY.architecture_for_gguf(arch)

    def need(key: str):
        if f"{arch}.{key}" not in md:
            raise ConfigError(f"GGUF metadata lacks {arch}.{key}")
        return md[f"{arch}.{key}"]

    def number(key: str, default: float | None = None) -> float:
        """A float key's value (metadata is typed: a string or a flag is not a number); without a default the key
        must be there."""
        value = need(key) if default is None else md.get(f"{arch}.{key}", default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"GGUF metadata {arch}.{key} must be a number, got {value!r}")
        return float(value)

    heads = need("attention.head_count")
    head_dim = md.get(f"{arch}.attention.key_length")  # absent: embedding_length / head_count
    _check_head_widths(md, arch, head_dim)
    scaling = None
    kind = md.get(f"{arch}.rope.scaling.type")
    if kind and kind != "none":
        scaling = {"rope_type": kind, "factor": number("rope.scaling.factor")}
        if f"{arch}.rope.scaling.original_context_length" in md:
            scaling["original_max_position_embeddings"] = md[f"{arch}.rope.scaling.original_context_length"]
        # yarn_attn_factor is HF's attention_factor as convert_hf_to_gguf writes it: the whole cos/sin magnitude,
        # in place of 0.1 ln(factor) + 1 (llama.cpp's Qwen graphs do not read it; HF, whose model the file is, does)
        optional = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
                    "yarn_attn_factor": "attention_factor"}
        for gguf_key, hf_key in optional.items():
            if f"{arch}.rope.scaling.{gguf_key}" in md:
                scaling[hf_key] = number(f"rope.scaling.{gguf_key}")
    tokens = md.get("tokenizer.ggml.tokens")
    family_fields = getattr(MODEL_REGISTRY.model_class(architecture), "gguf_config_fields", None)
    # config field -> the GGUF key it comes from, so that the config's checks name the key
    gguf_keys = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
                 "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
                 "num_key_value_heads": "attention.head_count_kv", "max_position_embeddings": "context_length",
                 "head_dim": "attention.key_length", "rope_theta": "rope.freq_base",
                 "rope_scaling": "rope.scaling.type", "rope_scaling.factor": "rope.scaling.factor",
                 "vocab_size": "vocab_size"}
    try:
        return ModelConfig(
            vocab_size=len(tokens) if tokens else need("vocab_size"),
            hidden_size=need("embedding_length"),
            intermediate_size=need("feed_forward_length"),
            num_hidden_layers=need("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=md.get(f"{arch}.attention.head_count_kv", heads),
            max_position_embeddings=need("context_length"),
            rms_norm_eps=number("attention.layer_norm_rms_epsilon"),
            rope_theta=number("rope.freq_base", DEFAULT_ROPE_THETA),
            rope_scaling=scaling,
            head_dim=head_dim,
            tie_word_embeddings=False,  # decided by the tensors present, see GGUFCheckpoint
            attention_bias=None,  # likewise
            torch_dtype="bfloat16",
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
            architectures=(architecture,),
            extra=family_fields(md, arch, tensor_names) if family_fields else {},
        )
    except ConfigError as e:  # worded for config.json: add the key the field comes from
        field_named = re.match(r"config field ([\w.]+)", str(e))
        key = gguf_keys.get(field_named[1]) if field_named else None
        if key is None or (field_named[1] == "vocab_size" and tokens):
            raise
        raise ConfigError(f"{e} (GGUF key {arch}.{key})") from e


def _check_head_widths(md: dict, arch: str, key_length) -> None:
    """qwenserve's attention has one head width for q, k and v and rotates whole heads: a file whose value
    heads or rotary width differ from its key heads' is refused."""
    heads, width = md.get(f"{arch}.attention.head_count"), md.get(f"{arch}.embedding_length")
    if key_length is not None:
        head_width, said = key_length, f"{arch}.attention.key_length ({key_length})"
    elif isinstance(heads, int) and isinstance(width, int) and heads > 0 and width % heads == 0:
        head_width, said = width // heads, f"the head width {arch}.embedding_length / attention.head_count " \
                                           f"({width // heads})"
    else:
        return  # the config's checks report it
    value_length = md.get(f"{arch}.attention.value_length")
    if value_length is not None and value_length != head_width:
        raise ConfigError(f"GGUF metadata {arch}.attention.value_length ({value_length}) differs from {said}; "
                          "qwenserve's attention takes one head width for keys and values")
    rotary = md.get(f"{arch}.rope.dimension_count")
    if rotary is not None and rotary != head_width:
        raise ConfigError(f"GGUF metadata {arch}.rope.dimension_count ({rotary}) differs from {said}; qwenserve's "
                          "rotary embedding turns whole heads")


class GGUFCheckpoint(Checkpoint):
    """A llama.cpp GGUF file. A 3-D tensor of a layer's experts ([experts, rows, row length], e.g.
    blk.N.ffn_gate_exps) comes out as one tensor per expert, each from its own bytes: where the quantization keeps
    blocks at all (keep_types), a quantized expert comes as its blocks (a view of the file), whatever its type, and
    the experts' layer keeps them or re-quantizes them to a type the kernel runs (quantization/gguf_experts.py);
    otherwise, and for float experts, each is dequantized alone."""
    format = "gguf"

    def __init__(self, path: str, model_id: str | None = None, config: ModelConfig | None = None,
                 model_class: type | None = None, hf_overrides: dict | None = None):
        """config: the one an engine resolved from this file, taken as it is; without it the metadata is read
        and checked. model_class: the class that runs it (default: the one registered for the config).
        hf_overrides: fields merged into the config.json the metadata makes, then read and checked as one."""
        self.file = GGUFFile(path)
        if config is None:
            try:
                config = config_from_gguf(self.file.metadata, frozenset(self.file.tensors))
            except ConfigError as e:  # the metadata's errors name the key; this names the file
                raise ConfigError(f"{path}: {e}") from e
            if "output.weight" not in self.file.tensors:  # no separate LM head: it is the embedding
                config = dataclasses.replace(config, tie_word_embeddings=True)
            config = dataclasses.replace(config, attention_bias="blk.0.attn_q.bias" in self.file.tensors)
            if hf_overrides:
                config = ModelConfig.from_hf_dict(merge_overrides(config.to_hf_dict(), hf_overrides))
        eos = _end_of_generation_ids(self.file.metadata, config.eos_token_id)
        generation = {"eos_token_id": eos} if eos else {}
        super().__init__(path, model_id or os.path.basename(path), config,
                         "llama.cpp GGUF names (blk.N.attn_q.weight, ...)", generation)
        model_class = model_class or MODEL_REGISTRY.model_class(config.architectures[0])
        self.layer_names = getattr(model_class, "gguf_layer_names", {})
        self.layer_count_key = f"GGUF metadata {self.file.metadata.get('general.architecture')}.block_count"

    native_quantization = "gguf"

    @property
    def weight_files(self) -> tuple[str, ...]:
        return (self.path,)

    def weights(self, keep_types: frozenset = frozenset()):
        for info in self.file.tensors.values():
            name, raw = gguf_to_hf_name(info.name, self.layer_names), self.file.raw(info.name)
            if EXPERT_INDEX in name:
                yield from self._experts(info, name, raw, blocks=bool(keep_types))
                continue
            if info.ggml_type in keep_types and len(info.shape) == 2:
                yield name, GGMLTensor.from_bytes(torch.from_numpy(raw), info.ggml_type, info.shape)
                continue
            if keep_types and info.ggml_type not in _FLOAT_TYPES and len(info.shape) == 2:
                logger.info("%s is %s, which our kernels do not run: dequantized at load", info.name,
                            info.ggml_type.name)
            yield name, dequantize(raw, info.ggml_type, info.shape)

    @staticmethod
    def _experts(info, name: str, raw, blocks: bool) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
        """(HF name of expert e, its [rows, row length] weight) for each expert of a stacked 3-D tensor; its bytes
        are the experts' one after another, so each comes alone (memory: one expert at a time): as its blocks
        where `blocks` and the tensor is quantized, else dequantized."""
        if len(info.shape) != 3:
            raise ValueError(f"GGUF tensor {info.name} has shape {list(info.shape)}; the experts' tensor must be "
                             "3-D [experts, rows, row length]")
        num_experts, per_expert = info.shape[0], info.nbytes // info.shape[0]
        as_blocks = blocks and info.ggml_type not in _FLOAT_TYPES
        for e in range(num_experts):
            expert = raw[e * per_expert:(e + 1) * per_expert]
            yield name.replace(EXPERT_INDEX, str(e)), (
                GGMLTensor.from_bytes(torch.from_numpy(expert), info.ggml_type, info.shape[1:]) if as_blocks
                else dequantize(expert, info.ggml_type, info.shape[1:]))

    def tokenizer(self):
        return tokenizer_from_gguf(self.file.metadata)

    def release_pages(self) -> None:
        self.file.release_pages()


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        found = json.load(f)
    if not isinstance(found, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return found


def _processor_configs(path: str) -> tuple[dict, dict | None]:
    """(image settings, video settings or None) of a VL checkpoint, in transformers' order: processor_config.json's
    nested image_processor / video_processor (as transformers 5 saves them), else preprocessor_config.json /
    video_preprocessor_config.json; videos without settings of their own take the images' (as transformers
    does)."""
    processor = _read_json(os.path.join(path, "processor_config.json")) or {}
    image = processor.get("image_processor")
    if not isinstance(image, dict):
        image = _read_json(os.path.join(path, "preprocessor_config.json")) or {}
    video = processor.get("video_processor")
    if not isinstance(video, dict):
        video = _read_json(os.path.join(path, "video_preprocessor_config.json"))
    return image, video

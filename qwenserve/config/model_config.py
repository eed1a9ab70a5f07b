"""The model's shape, read once from an HF config.json or GGUF metadata and validated in one place."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from qwenserve.config.dual_chunk_config import FIELD as DUAL_CHUNK_FIELD, DualChunkConfig
from qwenserve.config.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_ROPE_THETA = 1_000_000.0  # the Qwen models' real default; 10,000 makes long outputs drift
QWEN2_ARCHITECTURE = "Qwen2ForCausalLM"  # what a config.json without `architectures` but model_type qwen2 runs
ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# kv_cache_dtype (vLLM's values, fp8 meaning fp8_e4m3) -> the torch dtype of the cache's codes; auto: the run dtype,
# no codes
KV_CACHE_DTYPES = {"auto": None, "int8": "int8", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                   "fp8": "float8_e4m3fn"}


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a Qwen2-VL / Qwen2.5-VL checkpoint (config.json's vision_config, in one naming for
    both: Qwen2-VL calls the tower's width embed_dim and its output hidden_size, Qwen2.5-VL hidden_size and
    out_hidden_size) and the token ids that mark images in a prompt."""
    windowed: bool  # Qwen2.5-VL's tower: window attention, RMSNorm, gated MLP; else Qwen2-VL's
    depth: int
    hidden_size: int  # the tower's width
    out_hidden_size: int  # what the patch merger outputs: the language model's hidden size
    intermediate_size: int
    num_heads: int
    hidden_act: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112  # Qwen2.5-VL: the attention window's side in pixels
    fullatt_block_indexes: tuple[int, ...] = ()  # Qwen2.5-VL: blocks that attend over the whole image
    rope_theta: float = 10000.0
    # Qwen2.5-VL: temporal M-RoPE positions per second of video (a video's frames are spaced in time);
    # Qwen2-VL: None, its frames are one position apart
    tokens_per_second: float | None = None

    def __post_init__(self):
        for name in ("depth", "hidden_size", "out_hidden_size", "intermediate_size", "num_heads", "in_channels",
                     "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field vision_config.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"config field vision_config.hidden_size ({self.hidden_size}) is not divisible by "
                              f"vision_config.num_heads ({self.num_heads})")
        if (self.hidden_size // self.num_heads) % 4:
            raise ConfigError("the vision tower's head dim (vision_config hidden_size / num_heads) must be a "
                              "multiple of 4 for its 2-D rotary embedding")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"config field vision_config.hidden_act is {self.hidden_act!r}; supported: "
                              f"{', '.join(VISION_ACTIVATIONS)}")
        if self.windowed:
            if self.window_tokens < 1:  # transformers would divide by zero cutting the windows
                raise ConfigError(f"config field vision_config.window_size ({self.window_size}) is smaller than "
                                  f"one merged token (patch_size {self.patch_size} x spatial_merge_size "
                                  f"{self.spatial_merge_size} pixels)")
            # an index past the tower names no block, as in transformers (its default names blocks 7 to 31)
            indexes = self.fullatt_block_indexes
            if not isinstance(indexes, tuple) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                          for i in indexes):
                raise ConfigError(f"config field vision_config.fullatt_block_indexes must be a list of block "
                                  f"indexes, got {indexes!r}")

    @classmethod
    def from_hf_dict(cls, cfg: dict, windowed: bool) -> "VisionConfig":
        """From config.json: its vision_config and the top level's image token ids. A field config.json leaves out
        takes transformers' default for it (its Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig), except the shape
        fields, which must be there."""
        vision = cfg.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError("config.json of a vision-language model lacks vision_config")
        if windowed:
            shape = dict(hidden_size=vision.get("hidden_size"), out_hidden_size=vision.get("out_hidden_size"),
                         intermediate_size=vision.get("intermediate_size"))
        else:
            width = vision.get("embed_dim")
            shape = dict(hidden_size=width, out_hidden_size=vision.get("hidden_size"),
                         intermediate_size=int(width * vision.get("mlp_ratio", 4)) if width else None)
        missing = [k for k, v in shape.items() if v is None] + [k for k in ("depth", "num_heads") if k not in vision]
        missing += [k for k in _VISION_TOKENS if not isinstance(cfg.get(k), int)]
        if missing:
            raise ConfigError(f"config.json's vision model lacks field(s) {', '.join(missing)}")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise ConfigError(f"config field vision_config.rope_parameters.rope_type is {rope['rope_type']!r}; "
                              f"the vision towers take axial (2-D) rotary only")
        head_dim = vision.get("head_dim")
        if head_dim is not None and head_dim != shape["hidden_size"] // vision["num_heads"]:
            raise ConfigError(f"config field vision_config.head_dim ({head_dim}) differs from the tower's width "
                              f"over num_heads ({shape['hidden_size']} / {vision['num_heads']}); not supported")
        fullatt = vision.get("fullatt_block_indexes", QWEN2_5_VL_FULLATT_BLOCKS)
        return cls(
            windowed=windowed, depth=vision["depth"], num_heads=vision["num_heads"], **shape,
            hidden_act=vision.get("hidden_act", "silu" if windowed else "quick_gelu"),
            in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
            patch_size=vision.get("patch_size", 14), spatial_merge_size=vision.get("spatial_merge_size", 2),
            temporal_patch_size=vision.get("temporal_patch_size", 2), window_size=vision.get("window_size", 112),
            fullatt_block_indexes=(tuple(fullatt) if isinstance(fullatt, (list, tuple)) else fullatt) if windowed
            else (),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            tokens_per_second=vision.get("tokens_per_second", 4) if windowed else None,  # 4: transformers' default
            **{k: cfg[k] for k in _VISION_TOKENS})

    @property
    def window_tokens(self) -> int:
        """Qwen2.5-VL: a window's side in merged tokens, as transformers derives it (floored)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language-model token (2 x 2)."""
        return self.spatial_merge_size ** 2


VISION_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu", "swish", "relu")
# transformers' Qwen2_5_VLVisionConfig default: what a config.json without the field runs
QWEN2_5_VL_FULLATT_BLOCKS = (7, 15, 23, 31)
_VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# vision-language architectures whose tower is Qwen2.5-VL's (windowed); the other VL architectures use Qwen2-VL's
WINDOWED_VISION_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None  # {"rope_type": linear|dynamic|yarn, "factor": ..., ...}
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # the checkpoint's own dtype
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # config.json's `architectures` (for a GGUF file, the registered name of its general.architecture); the
    # model registry picks the first one it knows when the checkpoint is resolved
    architectures: tuple[str, ...] = (QWEN2_ARCHITECTURE,)
    # multimodal rotary (Qwen2-VL): how many of the head's rotary frequencies follow the temporal, height and
    # width positions (rope_scaling's mrope_section); None: plain 1-D rotary
    mrope_section: tuple[int, ...] | None = None
    vision: VisionConfig | None = None  # the vision tower of a vision-language checkpoint
    # the width of one attention head: config.json's head_dim where it gives one (Qwen3: 128 even where
    # hidden / heads is 64), else hidden_size / num_attention_heads
    head_dim: int | None = None
    # the attention projections' biases as config.json's attention_bias says; None: the family's own default
    # (Qwen2: q/k/v biases; Qwen3: none)
    attention_bias: bool | None = None
    # dual-chunk attention (config.json's dual_chunk_attention_config); None: ordinary attention
    dual_chunk: DualChunkConfig | None = None
    # config.json keys not modelled here (a family's own fields, for its model class, and for convert); for a GGUF
    # file, what its model class's gguf_config_fields makes of the metadata
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(f"config field hidden_size ({self.hidden_size}) is not divisible by "
                                  f"num_attention_heads ({self.num_attention_heads}) and config.json gives no "
                                  f"head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"config field head_dim must be a positive even integer, got {self.head_dim!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"config field hidden_act is {self.hidden_act!r}; Qwen models use 'silu', "
                              "the only activation qwenserve supports")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config field num_attention_heads ({self.num_attention_heads}) is not a multiple "
                              f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.rope_theta <= 0:
            raise ConfigError(f"config field rope_theta must be positive, got {self.rope_theta}")
        if self.torch_dtype not in DTYPES:
            raise ConfigError(f"config field torch_dtype is {self.torch_dtype!r}; expected one of {sorted(DTYPES)}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in ROPE_SCALING_TYPES:
                raise ConfigError(f"config field rope_scaling has type {kind!r}; supported: "
                                  f"{', '.join(ROPE_SCALING_TYPES)} (or none)")
            if not self.rope_scaling.get("factor") or self.rope_scaling["factor"] < 1:
                raise ConfigError(f"config field rope_scaling.factor must be >= 1, got {self.rope_scaling.get('factor')}")
        if self.mrope_section is not None:
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
                raise ConfigError(f"config field rope_scaling.mrope_section is {list(self.mrope_section)}; it needs "
                                  f"three sections (temporal, height, width) adding up to head_dim / 2 "
                                  f"({self.head_dim // 2})")
            if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "dynamic":
                raise ConfigError("config field rope_scaling: dynamic NTK scaling is not supported with "
                                  "mrope_section (multimodal rotary)")
        if self.dual_chunk is not None:
            # DCA remaps plain RoPE positions; a scaled or multimodal rotary on top has no reference to follow
            if self.rope_scaling is not None:
                raise ConfigError(f"config fields {DUAL_CHUNK_FIELD} and rope_scaling are both set; dual-chunk "
                                  f"attention runs on plain RoPE: remove one (e.g. --hf-overrides "
                                  f"'{{\"rope_scaling\": null}}')")
            if self.mrope_section is not None:
                raise ConfigError(f"config field {DUAL_CHUNK_FIELD} is not supported with multimodal rotary "
                                  f"(rope_scaling.mrope_section)")

    @property
    def derived_max_model_len(self) -> int:
        """The longest context the checkpoint supports: max_position_embeddings, stretched by rope scaling."""
        length = self.max_position_embeddings
        if self.rope_scaling is not None:
            if self.rope_scaling["rope_type"] == "yarn":
                length = self.rope_scaling.get("original_max_position_embeddings", length)
            length = int(length * self.rope_scaling["factor"])
        return length

    def resolve_max_model_len(self, requested: int | None) -> int:
        limit = self.derived_max_model_len
        if requested is None:
            return limit
        if requested <= 0:
            raise ConfigError(f"max_model_len must be positive, got {requested}")
        if requested > limit:
            raise ConfigError(f"max_model_len {requested} is larger than the model supports "
                              f"({limit}, from max_position_embeddings={self.max_position_embeddings}"
                              f"{' and rope_scaling' if self.rope_scaling else ''})")
        return requested

    # ---- readers -----------------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: dict, sparse_attention_file: bool = False) -> "ModelConfig":
        """From a config.json dict, in either transformers 4 (rope_theta/rope_scaling) or 5 (rope_parameters) form.
        A vision-language config keeps its language model's fields at the top level (as published) or in
        text_config (as transformers 5 saves it). sparse_attention_file: the checkpoint holds
        sparse_attention_config.json (dual-chunk attention's sparse part)."""
        if isinstance(cfg.get("text_config"), dict):
            text = cfg["text_config"]
            tied = bool(cfg.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
            cfg = {**text, **{k: v for k, v in cfg.items() if k != "text_config"}, "tie_word_embeddings": tied}
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"config field architectures must be a list of class names, got {archs!r}")
        if not archs:
            if cfg.get("model_type") not in (None, "qwen2"):
                raise ConfigError(f"config field model_type is {cfg.get('model_type')!r} and config.json names no "
                                  f"architectures; without them qwenserve runs model_type 'qwen2' only "
                                  f"(as {QWEN2_ARCHITECTURE})")
            archs = [QWEN2_ARCHITECTURE]
        if cfg.get("use_sliding_window"):
            raise ConfigError("config field use_sliding_window is true; sliding-window attention is not supported")
        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling")
        if legacy_scaling:
            rope.update(legacy_scaling)
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", DEFAULT_ROPE_THETA))
        mrope_section = rope.pop("mrope_section", None)
        vision = None
        if "vision_config" in cfg:
            windowed = any(a in WINDOWED_VISION_ARCHITECTURES for a in archs) or cfg.get("model_type") == "qwen2_5_vl"
            vision = VisionConfig.from_hf_dict(cfg, windowed)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ConfigError(f"config.json lacks required field(s) {', '.join(missing)}")
        known = {f.name for f in dataclasses.fields(cls)} | {"rope_parameters", "rope_scaling", "dtype",
                                                            DUAL_CHUNK_FIELD}
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=_normalize_rope_scaling(rope),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            architectures=tuple(archs),
            mrope_section=tuple(mrope_section) if mrope_section else None,
            vision=vision,
            head_dim=cfg.get("head_dim"),
            attention_bias=cfg.get("attention_bias"),
            dual_chunk=DualChunkConfig.from_hf(cfg.get(DUAL_CHUNK_FIELD), sparse_attention_file),
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def to_hf_dict(self) -> dict:
        """config.json for an HF-format directory (written by `qwenserve convert`)."""
        cfg = dict(self.extra)
        cfg.update(
            architectures=list(self.architectures), model_type=self.extra.get("model_type", "qwen2"),
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act, torch_dtype=self.torch_dtype, use_sliding_window=False,
            max_window_layers=self.num_hidden_layers, bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id, head_dim=self.head_dim,
        )
        if self.attention_bias is not None:
            cfg["attention_bias"] = self.attention_bias
        if self.dual_chunk is not None:
            cfg[DUAL_CHUNK_FIELD] = dataclasses.asdict(self.dual_chunk)
        cfg["rope_scaling"] = dict(self.rope_scaling, type=self.rope_scaling["rope_type"]) if self.rope_scaling else None
        return cfg

    def log_shape(self, dtype: torch.dtype, max_model_len: int) -> None:
        if self.dual_chunk is not None:
            d = self.dual_chunk
            logger.info("dual-chunk attention: chunks of %d tokens (chunk_size %d, local_size %d), "
                        "original_max_position_embeddings %d", d.chunk_len, d.chunk_size, d.local_size,
                        d.original_max_position_embeddings)
        logger.info("model: %d layers, hidden %d, %d heads, %d kv heads, head_dim %d, rope theta %g%s, dtype %s, "
                    "max_model_len %d", self.num_hidden_layers, self.hidden_size, self.num_attention_heads,
                    self.num_key_value_heads, self.head_dim, self.rope_theta,
                    f" ({self.rope_scaling['rope_type']} x{self.rope_scaling['factor']})" if self.rope_scaling else "",
                    str(dtype).removeprefix("torch."), max_model_len)


def _normalize_rope_scaling(rope: dict) -> dict | None:
    """HF's rope dict (either form) -> None for plain RoPE, else a dict with 'rope_type' and its parameters."""
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default", "mrope"):  # "mrope": Qwen2-VL's published name for plain RoPE with sections
        return None
    out = {k: v for k, v in rope.items() if k not in ("type", "rope_type", "rope_theta")}
    out["rope_type"] = kind
    return out


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig) -> torch.dtype:
    """'auto'/None -> the checkpoint's dtype (bfloat16 for GGUF); otherwise a name in DTYPES."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return dtype
    if dtype in (None, "auto"):
        return DTYPES[config.torch_dtype]
    name = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(dtype, dtype)
    if name not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The KV cache's code dtype for a kv_cache_dtype name; None for auto (the cache holds the run dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    name = KV_CACHE_DTYPES[kv_cache_dtype]
    if name is None:
        return None
    try:
        dtype = getattr(torch, name)
        torch.zeros(1).to(dtype)  # a build may name the fp8 dtypes yet not convert to them on the CPU
        return dtype
    except (AttributeError, RuntimeError, TypeError):
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} needs torch.{name}, which this torch "
                          f"({torch.__version__}) does not support on the CPU") from None

"""The model's shape, read once from an HF config.json or GGUF metadata and validated in one place."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from qwenserve.config.errors import ConfigError

logger = logging.getLogger(__name__)

QWEN2_DEFAULT_ROPE_THETA = 1_000_000.0  # Qwen2's real default; 10,000 makes long outputs drift
QWEN2_ARCHITECTURE = "Qwen2ForCausalLM"  # what a config.json without `architectures` but model_type qwen2 runs
ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# kv_cache_dtype (vLLM's values) -> the torch dtype of the cache's codes; auto: the run dtype, no codes
KV_CACHE_DTYPES = {"auto": None, "int8": "int8", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


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
    rope_theta: float = QWEN2_DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None  # {"rope_type": linear|dynamic|yarn, "factor": ..., ...}
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # the checkpoint's own dtype
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # config.json's `architectures` (for a GGUF file, the registered name of its general.architecture); the
    # model registry picks the first one it knows when the checkpoint is resolved
    architectures: tuple[str, ...] = (QWEN2_ARCHITECTURE,)
    extra: dict = field(default_factory=dict, compare=False)  # untouched config.json keys, for convert

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"config field hidden_act is {self.hidden_act!r}; Qwen2 models use 'silu', "
                              "the only activation qwenserve supports")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config field hidden_size ({self.hidden_size}) is not divisible by "
                              f"num_attention_heads ({self.num_attention_heads})")
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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """From a config.json dict, in either transformers 4 (rope_theta/rope_scaling) or 5 (rope_parameters) form."""
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
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", QWEN2_DEFAULT_ROPE_THETA))
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ConfigError(f"config.json lacks required field(s) {', '.join(missing)}")
        known = {f.name for f in dataclasses.fields(cls)} | {"rope_parameters", "rope_scaling", "dtype"}
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
            eos_token_id=self.eos_token_id,
        )
        cfg["rope_scaling"] = dict(self.rope_scaling, type=self.rope_scaling["rope_type"]) if self.rope_scaling else None
        return cfg

    def log_shape(self, dtype: torch.dtype, max_model_len: int) -> None:
        logger.info("model: %d layers, hidden %d, %d heads, %d kv heads, head_dim %d, rope theta %g%s, dtype %s, "
                    "max_model_len %d", self.num_hidden_layers, self.hidden_size, self.num_attention_heads,
                    self.num_key_value_heads, self.head_dim, self.rope_theta,
                    f" ({self.rope_scaling['rope_type']} x{self.rope_scaling['factor']})" if self.rope_scaling else "",
                    str(dtype).removeprefix("torch."), max_model_len)


def _normalize_rope_scaling(rope: dict) -> dict | None:
    """HF's rope dict (either form) -> None for plain RoPE, else a dict with 'rope_type' and its parameters."""
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
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

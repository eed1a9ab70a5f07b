"""Dual-chunk attention (DCA) as Qwen's 1M-token checkpoints configure it (config.json's
`dual_chunk_attention_config`), read and checked once; and `hf_overrides`, the JSON merged into a checkpoint's
config.json that turns it on for another Qwen2 / Qwen2.5 / Qwen3 checkpoint.

DCA cuts a sequence into chunks of chunk_size - local_size tokens and remaps positions so that no query-key
distance exceeds chunk_size (docs/long_context.md). original_max_position_embeddings (0: off) sets the attention
temperature that grows with the sequence's length past it. The sparse-attention part (MInference's
vertical-and-slash prefill, `sparse_attention_config` or the checkpoint's sparse_attention_config.json) is not
implemented: a config that turns it on is refused with an error that says how to turn it off."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from qwenserve.config.errors import ConfigError

FIELD = "dual_chunk_attention_config"
SPARSE_OFF = '--hf-overrides \'{"dual_chunk_attention_config": {"sparse_attention_enabled": false}}\''
# keys of the sparse part: read only to see whether it is asked for
_SPARSE_KEYS = ("sparse_attention_config", "sparse_attention_enabled", "sparse_attention_threshold",
                "sparse_attention_last_q")
_KNOWN = ("chunk_size", "local_size", "original_max_position_embeddings") + _SPARSE_KEYS


@dataclass(frozen=True)
class DualChunkConfig:
    chunk_size: int  # the longest query-key distance the remapped positions reach
    local_size: int  # chunk_size - local_size tokens make one chunk
    original_max_position_embeddings: int = 0  # the trained window; 0: no length-dependent temperature

    def __post_init__(self):
        for name in ("chunk_size", "local_size", "original_max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"config field {FIELD}.{name} must be an integer, got {value!r}")
        if self.chunk_size <= 0:
            raise ConfigError(f"config field {FIELD}.chunk_size must be positive, got {self.chunk_size}")
        if self.local_size <= 0:
            raise ConfigError(f"config field {FIELD}.local_size must be positive, got {self.local_size}")
        if self.local_size >= self.chunk_size:
            raise ConfigError(f"config field {FIELD}.local_size ({self.local_size}) must be smaller than "
                              f"chunk_size ({self.chunk_size}): a chunk holds chunk_size - local_size tokens")
        if self.original_max_position_embeddings < 0:
            raise ConfigError(f"config field {FIELD}.original_max_position_embeddings must be 0 (off) or "
                              f"positive, got {self.original_max_position_embeddings}")

    @property
    def chunk_len(self) -> int:
        """Tokens per chunk."""
        return self.chunk_size - self.local_size

    def temperature(self, length: int) -> float:
        """The factor a query or key of a sequence `length` tokens long multiplies the logits by:
        0.1 ln(length / original_max_position_embeddings) + 1, at least 1 (1 while off)."""
        if self.original_max_position_embeddings <= 0 or length <= self.original_max_position_embeddings:
            return 1.0
        return 0.1 * math.log(length / self.original_max_position_embeddings) + 1.0

    @classmethod
    def from_hf(cls, value, sparse_file: bool = False) -> "DualChunkConfig | None":
        """config.json's dual_chunk_attention_config (None or absent: DCA off). sparse_file: the checkpoint
        directory holds sparse_attention_config.json, which turns the sparse part on unless
        sparse_attention_enabled is false."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ConfigError(f"config field {FIELD} must be an object such as "
                              f'{{"chunk_size": 262144, "local_size": 8192}}, got {value!r}')
        unknown = sorted(k for k in value if k not in _KNOWN)
        if unknown:
            raise ConfigError(f"config field {FIELD} has unknown key(s) {', '.join(unknown)}; known: "
                              f"{', '.join(_KNOWN)}")
        missing = [k for k in ("chunk_size", "local_size") if k not in value]
        if missing:
            raise ConfigError(f"config field {FIELD} lacks {', '.join(missing)}")
        enabled = value.get("sparse_attention_enabled")
        if enabled is not None and not isinstance(enabled, bool):
            raise ConfigError(f"config field {FIELD}.sparse_attention_enabled must be true or false, got "
                              f"{enabled!r}")
        has_sparse_config = bool(value.get("sparse_attention_config")) or sparse_file
        if enabled or (enabled is None and has_sparse_config):
            where = ("sparse_attention_config" if value.get("sparse_attention_config")
                     else "the checkpoint's sparse_attention_config.json" if sparse_file
                     else "sparse_attention_enabled")
            raise ConfigError(f"config field {FIELD} turns on its sparse attention ({where}), which qwenserve "
                              f"does not implement; run dense dual-chunk attention with sparse_attention_enabled "
                              f"false, e.g. {SPARSE_OFF}")
        return cls(chunk_size=value["chunk_size"], local_size=value["local_size"],
                   original_max_position_embeddings=value.get("original_max_position_embeddings", 0))


def parse_hf_overrides(value) -> dict | None:
    """hf_overrides' value (a dict, or its JSON as the CLI passes it) -> a dict, or None when empty."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"hf_overrides is not valid JSON ({e}): {value!r}; expected an object such as "
                              f'\'{{"dual_chunk_attention_config": {{"chunk_size": 8192, "local_size": 1024}}}}\''
                              ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"hf_overrides must be a JSON object of config.json fields, got {value!r}")
    return value


def merge_overrides(config: dict, overrides: dict) -> dict:
    """config.json with overrides merged in: a nested object merges key by key, anything else replaces (null
    included, which clears a field)."""
    out = dict(config)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_overrides(out[key], value)
        else:
            out[key] = value
    return out

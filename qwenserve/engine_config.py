"""Engine settings: one validated object, shared by the Python API, the CLI and the server."""
from __future__ import annotations

import re
from dataclasses import dataclass

GiB = 1 << 30
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": GiB, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as '2GiB', '512MiB', '1.5GB' or '1073741824'."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory {value!r} is not a size (examples: 2GiB, 512MiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None: the bundled model
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | str = 2 * GiB  # bytes for the KV cache (CPU)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    device: str = "cpu"
    record_logits: bool = False  # keep each sampled step's logits on the outputs (compare, debugging: costly)

    def __post_init__(self):
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

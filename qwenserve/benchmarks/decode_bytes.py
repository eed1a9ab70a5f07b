"""What one batch-1 decode step of a GGUF model reads from memory, so a time per output token can be put beside
the machine's read bandwidth.

A step reads every weight tensor once, except: the token embedding (one row), a mixture of experts' stacked
expert tensors (`*_exps`: only the k chosen experts of each layer, expert_used_count of expert_count) and, where
the file has no `output.weight`, the tied head (the whole embedding, as the LM head). Attention reads the KV
cache of the context so far. Random router weights choose experts about uniformly, so every step reads k fresh
experts a layer: the figure is what a step must read, not what a cache could save.
"""
from __future__ import annotations

import torch

from qwenserve.config.model_config import ModelConfig
from qwenserve.model.loader.gguf_file import GGUFFile


def gguf_decode_weight_bytes(path: str) -> dict:
    """Bytes of weights one decode step reads: 'total', and its parts 'experts', 'head' and 'other'."""
    gguf = GGUFFile(path)
    arch = gguf.metadata["general.architecture"]
    used, count = gguf.metadata.get(f"{arch}.expert_used_count"), gguf.metadata.get(f"{arch}.expert_count")
    parts = {"experts": 0, "head": 0, "other": 0}
    for name, tensor in gguf.tensors.items():
        if name == "token_embd.weight":
            parts["other"] += tensor.nbytes // tensor.shape[0]  # the token's own row
            if "output.weight" not in gguf.tensors:
                parts["head"] += tensor.nbytes
        elif name == "output.weight":
            parts["head"] += tensor.nbytes
        elif "_exps." in name:
            parts["experts"] += tensor.nbytes * used // count
        else:
            parts["other"] += tensor.nbytes
    return {**parts, "total": sum(parts.values())}


def kv_bytes_per_context_token(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None) -> int:
    """The K and V bytes of one token of context over all layers (the cache's codes; scales not counted)."""
    element = (kv_cache_dtype or dtype).itemsize
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element

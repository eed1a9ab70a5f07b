"""One sequence at a time over a contiguous KV cache: greedy or temperature sampling.

This is the reference decoding loop that `generate` and `compare` use; the batched engine with a paged
cache builds on the same model and must produce the same greedy tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layers.attention import ContiguousKVCache
from .models.qwen2 import Qwen2ForCausalLM


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS / stop id) or "length"
    logits: list[torch.Tensor] = field(default_factory=list)  # per generated token, float32, when asked for


class SimpleGenerator:
    def __init__(self, model: Qwen2ForCausalLM, max_model_len: int):
        self.model = model
        self.max_model_len = max_model_len
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self._cache_shape = (cfg.num_hidden_layers, attn.num_kv_heads, attn.head_dim)
        self.dtype = model.lm_head.weight.dtype
        self.device = model.lm_head.weight.device

    def _new_cache(self, length: int) -> ContiguousKVCache:
        layers, kv_heads, head_dim = self._cache_shape
        return ContiguousKVCache(layers, length, kv_heads, head_dim, self.dtype, self.device)

    def _forward(self, cache: ContiguousKVCache, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(cache.start, cache.start + len(token_ids), device=self.device)
        hidden = self.model(ids, positions, cache)
        cache.advance(len(token_ids))
        return self.model.compute_logits(hidden if all_logits else hidden[-1:]).float()

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of `token_ids` ([T, vocab], float32), in one forward."""
        self._check_length(len(token_ids), 0)
        return self._forward(self._new_cache(len(token_ids)), token_ids, all_logits=True)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
                 stop_token_ids: set[int] | frozenset = frozenset(), seed: int | None = None,
                 keep_logits: bool = False) -> Generation:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self._check_length(len(prompt_ids), max_tokens)
        cache = self._new_cache(len(prompt_ids) + max_tokens)
        generator = torch.Generator(device=self.device)
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
        out, kept = [], []
        logits = self._forward(cache, prompt_ids)[-1]
        while True:
            if keep_logits:
                kept.append(logits)
            if temperature == 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            out.append(token)
            if token in stop_token_ids:
                return Generation(out, "stop", kept)
            if len(out) == max_tokens:
                return Generation(out, "length", kept)
            logits = self._forward(cache, [token])[-1]

    def _check_length(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(f"prompt too long: {prompt_len} prompt tokens + {max_tokens} max_tokens = "
                             f"{prompt_len + max_tokens} exceeds max_model_len {self.max_model_len}")

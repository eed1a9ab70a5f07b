"""Requests in: a prompt (text, token ids, or a dict of either) and sampling parameters, tokenized and checked
against the model and the KV cache before anything is queued. A bad request raises RequestError naming the
field at fault, and leaves nothing behind."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qwenserve.config.errors import RequestError
from qwenserve.lora.peft import LoRAAdapterError
from qwenserve.lora.registry import AdapterRegistry
from qwenserve.lora.request import LoRARequest
from qwenserve.sample.grammar import check_constraint
from qwenserve.sample.sampling_params import SamplingParams


@dataclass
class ProcessedRequest:
    prompt: str | None  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens resolved, eos_token_ids filled in
    lora_request: LoRARequest | None = None  # the adapter it runs with, checked; None: the base model


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 block_size: int, num_kv_blocks: int, adapters: AdapterRegistry | None = None):
        """adapters: the engine's LoRA adapters, with enable_lora; None: requests may not name one."""
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise RequestError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}",
                           param="prompt")

    def process(self, prompt: str | list[int] | dict, params: SamplingParams,
                lora_request: LoRARequest | None = None) -> ProcessedRequest:
        text, ids = self.tokenize(prompt)
        self._check(ids, params)
        self._check_adapter(lora_request)
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        params = dataclasses.replace(params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids)
        return ProcessedRequest(text, ids, params, lora_request)

    def _check_adapter(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                               param="lora_request")
        if self.adapters is None:
            raise RequestError(f"this request names LoRA adapter {lora_request.lora_name!r}, but the engine was "
                               f"started without enable_lora", param="lora_request")
        try:
            self.adapters.check(lora_request)
        except LoRAAdapterError as e:
            raise RequestError(str(e), param="lora_request") from None

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            check_constraint(params.structured_outputs)
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}",
                               param="prompt")
        # vLLM's wording, which clients and their users already know
        if len(ids) >= self.max_model_len:  # not even one token would fit after it
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                               f"request has {len(ids)} input tokens. Please reduce the length of the input messages.",
                               param="prompt")
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} "
                               f"in the completion). Please reduce the length of the messages or completion.",
                               param="max_tokens")
        need = -(-(len(ids) + max_tokens) // self.block_size)
        if need > self.num_kv_blocks:
            raise RequestError(f"this request could never fit in the KV cache: {len(ids)} prompt tokens + "
                               f"{max_tokens} max_tokens need {need} blocks of {self.block_size} tokens, and the "
                               f"whole cache has {self.num_kv_blocks} (lower max_tokens, or raise kv_cache_memory)",
                               param="prompt" if params.max_tokens is None else "max_tokens")

"""Requests in: a prompt (text, token ids, or a dict of either, with images under "multi_modal_data" for a
vision-language model) and sampling parameters, tokenized and checked against the model and the KV cache before
anything is queued. Images are preprocessed here and each one's placeholder expanded to its size in tokens. A bad
request raises RequestError naming the field at fault, and leaves nothing behind."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qwenserve.config.errors import RequestError
from qwenserve.core.multimodal import ImageInput
from qwenserve.lora.peft import LoRAAdapterError
from qwenserve.lora.registry import AdapterRegistry
from qwenserve.lora.request import LoRARequest
from qwenserve.model.models.qwen2_vl_processor import ProcessedImage, Qwen2VLProcessor
from qwenserve.sample.grammar import check_constraint
from qwenserve.sample.sampling_params import SamplingParams


@dataclass
class ProcessedRequest:
    prompt: str | None  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens resolved, eos_token_ids filled in
    lora_request: LoRARequest | None = None  # the adapter it runs with, checked; None: the base model
    images: tuple[ImageInput, ...] = ()  # in prompt order; their placeholders are expanded in prompt_token_ids


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 block_size: int, num_kv_blocks: int, adapters: AdapterRegistry | None = None,
                 image_processor: Qwen2VLProcessor | None = None, mm_limits: dict[str, int] | None = None):
        """adapters: the engine's LoRA adapters, with enable_lora; None: requests may not name one.
        image_processor: the model's, None for a text-only model; mm_limits: the most items of each modality one
        prompt may hold (limit_mm_per_prompt)."""
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.image_processor = image_processor
        self.mm_limits = mm_limits or {}
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

    def prompt_token_ids(self, prompt: str | list[int] | dict) -> list[int]:
        """The token ids the engine runs for the prompt (its image and video placeholders expanded), unchecked
        against the context length and the KV cache: what /tokenize reports. RequestError as process's."""
        return self._images(prompt, self.tokenize(prompt)[1])[0]

    def process(self, prompt: str | list[int] | dict, params: SamplingParams,
                lora_request: LoRARequest | None = None) -> ProcessedRequest:
        text, ids = self.tokenize(prompt)
        ids, images = self._images(prompt, ids)
        self._check(ids, params)
        self.check_adapter(lora_request)
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        params = dataclasses.replace(params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids)
        return ProcessedRequest(text, ids, params, lora_request, images)

    def check_adapter(self, lora_request: LoRARequest | None) -> None:
        """RequestError naming the field or tensor if the adapter cannot be served (None: the base model)."""
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

    def _images(self, prompt, ids: list[int]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with its image and video placeholders expanded, and its images and videos in prompt order
        (a video is an ImageInput whose grid has several frames), from prompt["multi_modal_data"]."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        vision = self.image_processor.vision if self.image_processor is not None else None
        if not data:
            for kind, pad in (("image", vision.image_token_id), ("video", vision.video_token_id)) if vision else ():
                if pad in ids:
                    raise RequestError(f"the prompt has {kind} placeholders (<|{kind}_pad|>) but no {kind}s",
                                       param="multi_modal_data")
            return ids, ()
        if not isinstance(data, dict):
            raise RequestError("multi_modal_data must be a dict such as {'image': [...]}", param="multi_modal_data")
        unknown = [k for k in data if k not in ("image", "video")]
        if unknown:
            raise RequestError(f"multi_modal_data holds {unknown}; this engine takes images ('image') and videos "
                               f"('video')", param="multi_modal_data")
        if self.image_processor is None:
            raise RequestError("this model is text-only: it takes no images or videos", param="multi_modal_data")
        processed = {}
        for kind, process in (("image", self.image_processor.process),
                              ("video", self.image_processor.process_video)):
            raw = _items(data.get(kind), kind)
            limit = self.mm_limits.get(kind, len(raw))
            if len(raw) > limit:
                raise RequestError(f"the prompt holds {len(raw)} {kind}s; at most {limit} are allowed "
                                   f"(limit_mm_per_prompt)", param="multi_modal_data")
            processed[kind] = []
            for i, item in enumerate(raw):
                try:  # the server preprocesses off the engine's thread and hands over ProcessedImages
                    processed[kind].append(item if isinstance(item, ProcessedImage) else process(item))
                except RequestError as e:
                    raise RequestError(f"{kind} {i + 1}: {e}", param=f"multi_modal_data.{kind}[{i}]") from None
        ids, image_offsets, video_offsets = self.image_processor.expand_placeholders(ids, processed["image"],
                                                                                     processed["video"])
        inputs = [ImageInput(offset, p.num_tokens, p.grid, p.content_hash, p.pixel_values, p.time_interval)
                  for offsets, kind in ((image_offsets, "image"), (video_offsets, "video"))
                  for offset, p in zip(offsets, processed[kind])]
        return ids, tuple(sorted(inputs, key=lambda item: item.offset))

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


def _video_with_metadata(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)


def _items(value, kind: str) -> list:
    """multi_modal_data's value for one modality as a list of items. An image: one, or a list of them. A video
    is itself a list of frames (or a uint8 array [frames, height, width, 3], or one preprocessed, or (frames,
    metadata) with its frame rate as metadata["fps"], vLLM's form): a list of such lists, arrays, pairs or
    ProcessedImages is several videos; a flat list of frames, one."""
    import numpy as np
    if value is None:
        return []
    if kind == "image":
        return list(value) if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, np.ndarray) or _video_with_metadata(value):
        return [value]
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple, np.ndarray,
                                                                             ProcessedImage)):
        return list(value)
    return [value]


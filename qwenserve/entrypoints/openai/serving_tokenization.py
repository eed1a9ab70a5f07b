"""/tokenize and /detokenize: the served model's tokenizer, without generating."""
from __future__ import annotations

from qwenserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from qwenserve.entrypoints.openai.serving_engine import APIError, chat_ids
from qwenserve.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization:
    def __init__(self, tokenizer, models: OpenAIServingModels):
        self.tokenizer = tokenizer
        self.models = models

    def tokenize(self, body: TokenizeRequest) -> dict:
        self.models.model_name(body.model)
        if body.messages is not None:
            ids = chat_ids(self.tokenizer, body.messages, body.add_generation_prompt)
        elif body.prompt is not None:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.models.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.models.model_name(body.model)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

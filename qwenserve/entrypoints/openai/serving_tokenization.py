"""/tokenize and /detokenize: the served model's tokenizer, without generating. A conversation's tokens are the
prompt /v1/chat/completions runs for it, its images and videos included (chat_prompt.py renders both)."""
from __future__ import annotations

from qwenserve.entrypoints.openai.chat_prompt import ChatPromptRenderer
from qwenserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from qwenserve.entrypoints.openai.serving_engine import APIError
from qwenserve.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization:
    def __init__(self, tokenizer, models: OpenAIServingModels, renderer: ChatPromptRenderer):
        self.tokenizer = tokenizer
        self.models = models
        self.renderer = renderer

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.models.model_name(body.model)
        if body.messages is not None:
            # media are fetched and preprocessed as for chat: an image's count of tokens depends on its size
            chat = await self.renderer.render(body.messages, body.add_generation_prompt,
                                              template_kwargs=body.chat_template_kwargs,
                                              continue_final_message=body.continue_final_message)
            ids = self.renderer.engine_ids(chat)
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

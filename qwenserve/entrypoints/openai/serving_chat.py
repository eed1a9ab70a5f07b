"""/v1/chat/completions: a conversation rendered with the chat template, answered whole or streamed."""
from __future__ import annotations

import time

from fastapi import Request

from qwenserve.engine.outputs import RequestOutput
from qwenserve.entrypoints.openai.protocol import ChatCompletionRequest
from qwenserve.entrypoints.openai.serving_engine import (
    OpenAIServing,
    chat_ids,
    engine_ids_prefix,
    request_id,
    usage,
)


class OpenAIServingChat(OpenAIServing):
    PROMPT_PARAM = "messages"  # the prompt is made of the messages

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        model = self.models.model_name(body.model)
        params = self._params(body)
        ids = chat_ids(self.tokenizer, body.messages, body.add_generation_prompt)
        rid = f"chatcmpl-{request_id(request)}"
        created = int(time.time())
        admitted = await self._admit([{"prompt_token_ids": ids}], params, engine_ids_prefix(request, rid), body)
        top_k = params.logprobs or 0
        if body.stream:
            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(params.n)]
            header = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
            return self._stream(request, header, admitted, body, self._delta_choices(params.n, top_k), first)
        out = (await self._run(admitted, request))[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c, top_k), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": usage([out])}

    def _delta_choices(self, n: int, top_k: int):
        """The streamed choices of each output: its new text and the logprobs not sent yet."""
        sent_logprobs = [0] * n

        def choices(_, out: RequestOutput):
            for comp in out.outputs:
                logprobs = None
                if comp.logprobs is not None and len(comp.logprobs) > sent_logprobs[comp.index]:
                    full = self._logprobs(comp, top_k)["content"]
                    logprobs = {"content": full[sent_logprobs[comp.index]:]}
                    sent_logprobs[comp.index] = len(full)
                if not comp.text_delta and not comp.finished and logprobs is None:
                    continue
                delta = {"content": comp.text_delta} if comp.text_delta or not comp.finished else {}
                yield {"index": comp.index, "delta": delta, "logprobs": logprobs, "finish_reason": comp.finish_reason}

        return choices

    def _logprobs(self, comp, top_k: int) -> dict | None:
        if comp.logprobs is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for token_id, entry in zip(comp.token_ids, comp.logprobs):
            top = sorted(entry.values(), key=lambda lp: lp.rank)[:top_k]
            content.append(item(token_id, entry[token_id].logprob)
                           | {"top_logprobs": [item(lp.token_id, lp.logprob) for lp in top]})
        return {"content": content}

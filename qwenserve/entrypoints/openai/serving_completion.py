"""/v1/completions: text completions of one or more prompts, whole or streamed."""
from __future__ import annotations

import time

from fastapi import Request

from qwenserve.engine.outputs import RequestOutput
from qwenserve.entrypoints.openai.protocol import CompletionRequest
from qwenserve.entrypoints.openai.serving_engine import (
    APIError,
    OpenAIServing,
    engine_ids_prefix,
    request_id,
    usage,
)


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt must not be empty", param="prompt")
    return prompts


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, body: CompletionRequest, request: Request):
        model, lora_request = self.models.resolve(body.model)
        prompts = _prompts(body.prompt)
        params = self._params(body)
        rid = f"cmpl-{request_id(request)}"
        header = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
        admitted = await self._admit([self._tokenized(p) for p in prompts], params, engine_ids_prefix(request, rid),
                                     body, lora_request)
        if body.stream:
            return self._stream(request, header, admitted, body, self._delta_choices(params.n, body.echo))
        outs = await self._run(admitted, request)
        choices = []
        for i, out in enumerate(outs):
            echo = self._echo(out) if body.echo else ""
            for comp in out.outputs:
                choices.append({"index": i * params.n + comp.index, "text": echo + comp.text,
                                "logprobs": self._logprobs(comp, out, body.echo),
                                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
        return header | {"choices": choices, "usage": usage(outs)}

    def _tokenized(self, prompt: str | list[int]) -> dict:
        """A prompt as the engine takes it, tokenized here (as the engine would) so that admission knows its
        length before anything is queued."""
        if isinstance(prompt, list):
            return {"prompt_token_ids": prompt}
        return {"prompt": prompt, "prompt_token_ids": self.tokenizer.encode(prompt, add_special_tokens=False)}

    def _echo(self, out: RequestOutput) -> str:
        """The prompt's text, for echo."""
        return out.prompt or self.tokenizer.decode(out.prompt_token_ids)

    def _delta_choices(self, n: int, echo: bool):
        """The streamed choices of each output: its new text (led by the prompt's with echo)."""
        sent_echo = set()

        def choices(i: int, out: RequestOutput):
            for comp in out.outputs:
                index = i * n + comp.index
                text = comp.text_delta
                if echo and index not in sent_echo:
                    text = self._echo(out) + text
                    sent_echo.add(index)
                if not text and not comp.finished:
                    continue
                yield {"index": index, "text": text, "logprobs": None, "finish_reason": comp.finish_reason,
                       "stop_reason": comp.stop_reason}

        return choices

    def _logprobs(self, comp, out: RequestOutput, echo: bool) -> dict | None:
        """OpenAI's completions logprobs; with echo the prompt's tokens come first (the first has none)."""
        if comp.logprobs is None:
            return None
        pairs = list(zip(comp.token_ids, comp.logprobs))
        if echo:
            pairs = list(zip(out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids))) + pairs
        tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
        for token_id, entry in pairs:
            text = self._token_text(token_id)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            token_lps.append(entry[token_id].logprob if entry else None)
            top: dict[str, float] | None = None
            if entry:
                top = {}
                for lp in sorted(entry.values(), key=lambda lp: lp.rank):  # keyed by text: the likelier token wins
                    top.setdefault(self._token_text(lp.token_id), lp.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

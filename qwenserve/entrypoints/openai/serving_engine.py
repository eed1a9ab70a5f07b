"""What the OpenAI endpoints share: errors, admitting a request's prompts, running them to the end or streaming
them as server-sent events, usage, and recording finished requests in the metrics."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from qwenserve.config.errors import RequestError
from qwenserve.engine.async_engine import AsyncLLMEngine, OverloadedError
from qwenserve.engine.outputs import RequestOutput
from qwenserve.entrypoints.openai.metrics import ServerMetrics
from qwenserve.model.loader.tokenizer import chat_prompt_ids

RETRY_AFTER_S = "1"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def error_response(status: int, message: str, type_: str, param: str | None = None, code=None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content=error_body(message, type_, param, code))


def error_body(message: str, type_: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def chat_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    """The prompt of a conversation; one the chat template cannot render is the messages' fault."""
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return chat_prompt_ids(tokenizer, plain, add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


Admitted = list[tuple[str, asyncio.Queue]]  # (request id, its output stream) for each prompt of a request


class OpenAIServing:
    """The base of the generating endpoints (completions, chat)."""
    DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
    PROMPT_PARAM = "prompt"  # the request field an engine complaint about the prompt is reported against

    def __init__(self, engine: AsyncLLMEngine, models, metrics: ServerMetrics):
        self.engine = engine
        self.models = models
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.defaults = engine.generation_defaults

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bad_request(self, e: ValueError) -> APIError:
        """A RequestError names the field at fault; any other ValueError names none."""
        param = e.param if isinstance(e, RequestError) else None
        return APIError(400, str(e), param=self.PROMPT_PARAM if param == "prompt" else param)

    def _params(self, body):
        try:
            return body.sampling_params(self.defaults)
        except ValueError as e:
            raise self._bad_request(e) from e

    async def _admit(self, prompts: list, params, prefix: str) -> Admitted:
        """Admit every prompt before answering, so a bad one is a 400 (and admits none of the others)."""
        admitted = []
        try:
            for i, prompt in enumerate(prompts):
                rid = f"{prefix}-{i}"
                admitted.append((rid, await self.engine.add_request(rid, prompt, params)))
        except (ValueError, OverloadedError) as e:
            for rid, _ in admitted:
                self.engine.abort(rid)
            if isinstance(e, OverloadedError):
                raise APIError(503, str(e), "server_overloaded", headers={"Retry-After": RETRY_AFTER_S}) from e
            raise self._bad_request(e) from e
        return admitted

    async def _outputs(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """One request's outputs; the one place a finished request is counted in the metrics (one the client
        left early is aborted, not finished)."""
        async for out in self.engine.stream(request_id, stream):
            if out.finished:
                self.metrics.record_finished(out)
            yield out

    async def _merged_outputs(self, admitted: Admitted) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every admitted request as they come, until all have finished; an engine
        failure is raised. Leaving early (client gone, task cancelled) aborts whatever is still running."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, request_id, stream):
            try:
                async for out in self._outputs(request_id, stream):
                    await queue.put((i, out))
            except Exception as e:  # noqa: BLE001 - an engine failure, raised to the reader below
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, r, s)) for i, (r, s) in enumerate(admitted)]
        try:
            unfinished = len(admitted)
            while unfinished:
                i, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                yield i, out
                if out.finished:
                    unfinished -= 1
        finally:
            for t in tasks:  # client gone or done: the engine aborts whatever is still running
                t.cancel()

    async def _run(self, admitted: Admitted, request: Request) -> list[RequestOutput]:
        """Every admitted request to its end; a client that goes away aborts them all."""
        async def finals():
            last = {}
            async for i, out in self._merged_outputs(admitted):
                last[i] = out
            return [last[i] for i in range(len(admitted))]

        task = asyncio.ensure_future(finals())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=self.DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    raise asyncio.CancelledError
            return task.result()
        finally:
            task.cancel()

    def _stream(self, header: dict, admitted: Admitted, body,
                choices: Callable[[int, RequestOutput], Iterable[dict]], first: Iterable[dict] = ()
                ) -> StreamingResponse:
        """Server-sent events: a chunk (header + one choice) for each of `first`, then for each choice that
        `choices(prompt index, output)` makes of the outputs as they come, the usage chunk if the request asked
        for it, and [DONE]."""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            outputs = self._merged_outputs(admitted)
            try:
                for choice in first:
                    yield sse(header | {"choices": [choice]})
                finals = {}
                async for i, out in outputs:
                    for choice in choices(i, out):
                        yield sse(header | {"choices": [choice]})
                    if out.finished:
                        finals[i] = out
                if include_usage:
                    yield sse(header | {"choices": [], "usage": usage(list(finals.values()))})
                yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - an engine failure mid-stream: the status is already sent
                yield sse(error_body(str(e), "server_error"))
            finally:
                await outputs.aclose()  # client gone: abort the requests now, not when the generator is collected

        return StreamingResponse(events(), media_type="text/event-stream")

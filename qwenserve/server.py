"""The OpenAI-compatible HTTP server (FastAPI) over the async engine."""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .async_engine import AsyncLLMEngine, OverloadedError
from .metrics import ServerMetrics
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .tokenizer import chat_prompt_ids

logger = logging.getLogger(__name__)
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


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
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _bad_value(e: ValueError, prompt_param: str = "prompt") -> APIError:
    """SamplingParams' errors start with the parameter's name ('top_p must be ...'); the engine's are about
    the prompt ('prompt too long: ...')."""
    message = str(e)
    first = message.split(" ", 1)[0]
    param = first if first in _SAMPLING_FIELDS else prompt_param if "prompt" in message else None
    return APIError(400, message, param=param)


class APIKeyMiddleware:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects from the routes).
    The comparison is constant-time."""

    def __init__(self, app, api_key: str, open_paths: set[str]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                                          "authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServer:
    DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], api_key: str | None = None,
                 metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        if engine.on_finished is None:
            engine.on_finished = self.metrics.record_finished
        self.names = served_model_names
        self.api_key = api_key
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        generation = engine.engine.loaded.checkpoint.generation_config
        self.defaults = {k: generation[k] for k in GENERATION_DEFAULT_KEYS if generation.get(k) is not None}
        if self.defaults:
            logger.info("sampling defaults from generation_config (used when a request does not set them): %s",
                        self.defaults)
        self.created = int(time.time())

    # ---- app ------------------------------------------------------------------------------------------

    def build_app(self) -> FastAPI:
        app = FastAPI(title="qwenserve")
        if self.api_key:
            app.add_middleware(APIKeyMiddleware, api_key=self.api_key, open_paths={"/health", "/metrics"})

        @app.exception_handler(APIError)
        async def api_error(_, e: APIError):
            return e.response()

        @app.exception_handler(RequestValidationError)
        async def validation_error(_, e: RequestValidationError):
            first = e.errors()[0] if e.errors() else {}
            loc = [str(p) for p in first.get("loc", ()) if p != "body"]
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
            return error_response(400, message, "invalid_request_error", loc[0] if loc else None)

        @app.get("/health")
        async def health():
            if not self.engine.alive:
                return error_response(503, "the engine is not running", "server_error")
            return JSONResponse({"status": "ok"})

        @app.get("/metrics")
        async def metrics():
            snap = await self.engine.call(ServerMetrics.snapshot)
            return Response(self.metrics.render(snap), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [
                {"id": name, "object": "model", "created": self.created, "owned_by": "qwenserve",
                 "max_model_len": self.max_model_len} for name in self.names]}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self.completions(body, request)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request):
            return await self.chat(body, request)

        @app.post("/tokenize")
        async def tokenize(body: TokenizeRequest):
            self._model_name(body.model)
            if body.messages is not None:
                ids = self._chat_ids(body.messages, body.add_generation_prompt)
            elif body.prompt is not None:
                ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                raise APIError(400, "give prompt or messages", param="prompt")
            return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

        @app.post("/detokenize")
        async def detokenize(body: DetokenizeRequest):
            self._model_name(body.model)
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in body.tokens):
                raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
            return {"prompt": self.tokenizer.decode(body.tokens)}

        return app

    # ---- helpers --------------------------------------------------------------------------------------

    def _model_name(self, requested: str | None) -> str:
        if requested is None or requested in self.names:
            return requested or self.names[0]
        raise APIError(404, f"The model `{requested}` does not exist. Served models: {', '.join(self.names)}",
                       param="model", code="model_not_found")

    def _chat_ids(self, messages, add_generation_prompt: bool) -> list[int]:
        plain = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return chat_prompt_ids(self.tokenizer, plain, add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    def _params(self, body):
        try:
            return body.sampling_params(self.defaults)
        except ValueError as e:
            raise _bad_value(e) from e

    async def _admit(self, prompts: list, params, prefix: str, prompt_param: str) -> list[tuple[str, asyncio.Queue]]:
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
            raise _bad_value(e, prompt_param) from e
        return admitted

    async def _run(self, admitted: list, request: Request) -> list[RequestOutput]:
        """Every admitted request to its end; a client that goes away aborts them all."""
        async def one(rid, stream):
            final = None
            async for out in self.engine.stream(rid, stream):
                final = out
            return final

        tasks = [asyncio.ensure_future(one(rid, stream)) for rid, stream in admitted]
        gathered = asyncio.ensure_future(asyncio.gather(*tasks))
        try:
            while not gathered.done():
                await asyncio.wait({gathered}, timeout=self.DISCONNECT_POLL_S)
                if not gathered.done() and await request.is_disconnected():
                    gathered.cancel()
                    raise asyncio.CancelledError
            return gathered.result()
        finally:
            for t in tasks:
                t.cancel()

    def _usage(self, outs: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- /v1/completions ------------------------------------------------------------------------------

    def _completion_prompts(self, prompt) -> list:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "prompt must not be empty", param="prompt")
        return [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]

    def _completion_logprobs(self, comp, out: RequestOutput, echo: bool) -> dict | None:
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

    async def completions(self, body: CompletionRequest, request: Request):
        model = self._model_name(body.model)
        prompts = self._completion_prompts(body.prompt)
        params = self._params(body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        admitted = await self._admit(prompts, params, rid, "prompt")
        if body.stream:
            return self._stream_completions(rid, model, created, admitted, params, body)
        outs = await self._run(admitted, request)
        choices = []
        for i, out in enumerate(outs):
            echo = (out.prompt or self.tokenizer.decode(out.prompt_token_ids)) if body.echo else ""
            for comp in out.outputs:
                choices.append({"index": i * params.n + comp.index, "text": echo + comp.text,
                                "logprobs": self._completion_logprobs(comp, out, body.echo),
                                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": self._usage(outs)}

    def _stream_completions(self, rid, model, created, admitted, params, body) -> StreamingResponse:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            finals: dict[int, RequestOutput] = {}
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i, request_id, stream):
                try:
                    async for out in self.engine.stream(request_id, stream):
                        await queue.put((i, out))
                except Exception as e:  # noqa: BLE001 - an engine failure, reported to the client below
                    await queue.put((i, e))

            tasks = [asyncio.ensure_future(pump(i, r, s)) for i, (r, s) in enumerate(admitted)]
            try:
                sent_echo = set()
                while len(finals) < len(admitted):
                    i, out = await queue.get()
                    if isinstance(out, Exception):
                        yield _sse({"error": {"message": str(out), "type": "server_error", "param": None,
                                              "code": None}})
                        return
                    for comp in out.outputs:
                        index = i * params.n + comp.index
                        text = comp.text_delta
                        if body.echo and index not in sent_echo:
                            text = (out.prompt or self.tokenizer.decode(out.prompt_token_ids)) + text
                            sent_echo.add(index)
                        if not text and not comp.finished:
                            continue
                        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                    "choices": [{"index": index, "text": text, "logprobs": None,
                                                 "finish_reason": comp.finish_reason,
                                                 "stop_reason": comp.stop_reason}]})
                    if out.finished:
                        finals[i] = out
                if include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": self._usage(list(finals.values()))})
                yield "data: [DONE]\n\n"
            finally:
                for t in tasks:  # client gone or done: the engine aborts whatever is still running
                    t.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- /v1/chat/completions -------------------------------------------------------------------------

    def _chat_logprobs(self, comp, top_k: int) -> dict | None:
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

    async def chat(self, body: ChatCompletionRequest, request: Request):
        model = self._model_name(body.model)
        params = self._params(body)
        ids = self._chat_ids(body.messages, body.add_generation_prompt)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        admitted = await self._admit([{"prompt_token_ids": ids}], params, rid, "messages")
        if body.stream:
            return self._stream_chat(rid, model, created, admitted[0], params, body)
        out = (await self._run(admitted, request))[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c, params.logprobs or 0), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": self._usage([out])}

    def _stream_chat(self, rid, model, created, admitted, params, body) -> StreamingResponse:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices, usage=None):
            data = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices}
            if usage is not None:
                data["usage"] = usage
            return _sse(data)

        async def events():
            outputs = self.engine.stream(*admitted)
            try:
                for i in range(params.n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                final = None
                sent_logprobs = [0] * params.n
                async for out in outputs:
                    final = out
                    for comp in out.outputs:
                        logprobs = None
                        if comp.logprobs is not None and len(comp.logprobs) > sent_logprobs[comp.index]:
                            full = self._chat_logprobs(comp, params.logprobs or 0)["content"]
                            logprobs = {"content": full[sent_logprobs[comp.index]:]}
                            sent_logprobs[comp.index] = len(full)
                        if not comp.text_delta and not comp.finished and logprobs is None:
                            continue
                        delta = {"content": comp.text_delta} if comp.text_delta or not comp.finished else {}
                        yield chunk([{"index": comp.index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": comp.finish_reason}])
                if include_usage:
                    yield chunk([], self._usage([final]))
                yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - an engine failure mid-stream: the status is already sent
                yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
            finally:
                await outputs.aclose()  # client gone: abort the request now, not when the generator is collected

        return StreamingResponse(events(), media_type="text/event-stream")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

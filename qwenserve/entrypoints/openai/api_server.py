"""The OpenAI-compatible HTTP server (FastAPI) over the async engine: the app, its routes, error handlers and
API key. What each endpoint does lives in the serving_* modules."""
from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from qwenserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from qwenserve.entrypoints.openai.metrics import ServerMetrics
from qwenserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from qwenserve.entrypoints.openai.serving_chat import OpenAIServingChat
from qwenserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from qwenserve.entrypoints.openai.serving_engine import APIError, error_response
from qwenserve.entrypoints.openai.serving_models import OpenAIServingModels
from qwenserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)
OPEN_PATHS = {"/health", "/metrics"}  # served without the API key


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


def build_app(engine: AsyncLLMEngine, served_model_names: list[str], api_key: str | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    server_metrics = metrics or ServerMetrics()
    if engine.generation_defaults:
        logger.info("sampling defaults from generation_config (used when a request does not set them): %s",
                    engine.generation_defaults)
    serving_models = OpenAIServingModels(served_model_names, engine.max_model_len)
    serving_completion = OpenAIServingCompletion(engine, serving_models, server_metrics)
    serving_chat = OpenAIServingChat(engine, serving_models, server_metrics)
    serving_tokenization = OpenAIServingTokenization(engine.tokenizer, serving_models)

    app = FastAPI(title="qwenserve")
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=OPEN_PATHS)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, e: EngineDeadError):  # e.g. a worker process died: this server cannot recover
        return error_response(503, str(e), "server_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, "invalid_request_error", loc[0] if loc else None)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return error_response(503, "the engine is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(server_metrics.render(await engine.stats()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return serving_models.show_available_models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving_completion.create_completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving_chat.create_chat_completion(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return serving_tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving_tokenization.detokenize(body)

    return app

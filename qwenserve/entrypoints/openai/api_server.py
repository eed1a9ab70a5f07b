"""The OpenAI-compatible HTTP server (FastAPI) over the async engine: the app, its routes, error handlers (every
error is OpenAI-shaped JSON) and its middleware (request ids and access log, the web UI's security headers, CORS,
API key, body-size limit). What each endpoint does lives in the serving_* modules."""
from __future__ import annotations

import hmac
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from qwenserve.config.server_config import SERVER_DEFAULTS, LoRAModulePath
from qwenserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from qwenserve.entrypoints.openai.chat_prompt import ChatPromptRenderer
from qwenserve.entrypoints.openai.metrics import ServerMetrics
from qwenserve.entrypoints.openai.reasoning import check_reasoning_parser
from qwenserve.entrypoints.openai.middleware import (
    BodySizeLimitMiddleware,
    HostCheckMiddleware,
    OpenAICORSMiddleware,
    RequestContextMiddleware,
    UISecurityHeadersMiddleware,
    is_loopback,
)
from qwenserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from qwenserve.entrypoints.openai.serving_chat import OpenAIServingChat
from qwenserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from qwenserve.entrypoints.openai.serving_engine import APIError, error_response
from qwenserve.entrypoints.openai.serving_models import OpenAIServingModels
from qwenserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)
WEBUI_DIR = Path(__file__).parent / "webui"  # the web UI's static files: index.html at /, the rest under /ui/
UI_PATHS = {"/"} | {f"/ui/{f.relative_to(WEBUI_DIR).as_posix()}" for f in WEBUI_DIR.rglob("*")
                    if f.is_file()}  # open: its API calls carry the key
OPEN_PATHS = {"/health"} | UI_PATHS  # served without the API key


def is_ui_path(path: str) -> bool:
    """Whether `path` is the web UI's (its page, or anything under /ui/): its responses carry the UI's
    Content-Security-Policy and the other UI_SECURITY_HEADERS."""
    return path == "/" or path == "/ui" or path.startswith("/ui/")


def is_open_path(path: str, metrics_public: bool = False) -> bool:
    """Whether `path` is served without the API key: /health, the web UI's files, and /metrics with
    --metrics-public (by default it is guarded: it tells how busy the server is)."""
    return path in OPEN_PATHS or (metrics_public and path == "/metrics")


class APIKeyMiddleware:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects from the routes).
    The comparison is constant-time."""

    def __init__(self, app, api_key: str, metrics_public: bool = False):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.metrics_public = metrics_public

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not is_open_path(scope["path"], self.metrics_public):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                                          "authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, served_model_names: list[str], api_key: str | None = None,
              metrics: ServerMetrics | None = None, *, max_n: int = SERVER_DEFAULTS.max_n,
              max_request_bytes: int = SERVER_DEFAULTS.max_request_bytes, allowed_origins: list[str] | None = None,
              metrics_public: bool = False, log_requests: bool = False,
              lora_modules: tuple[LoRAModulePath, ...] = (), allow_runtime_lora_updating: bool = False,
              reasoning_parser: str | None = None, host: str = SERVER_DEFAULTS.host,
              allowed_hosts: list[str] | None = None) -> FastAPI:
    """The app (the settings are ServerConfig's). api_key guards every route but is_open_path's; CORS is off
    unless allowed_origins names some; prompts and outputs are logged only with log_requests. `host` is the
    address the server listens on: on loopback, only requests whose Host header is a loopback name or one of
    allowed_hosts are answered (HostCheckMiddleware); elsewhere any Host is, unless allowed_hosts names some.
    lora_modules are checked and registered here (a bad one raises ConfigError naming it);
    allow_runtime_lora_updating adds the routes that load and unload adapters, with the engine's enable_lora."""
    server_metrics = metrics or ServerMetrics(served_model_names[0], engine.max_model_len)
    if engine.generation_defaults:
        logger.info("sampling defaults from generation_config (used when a request does not set them): %s",
                    engine.generation_defaults)
    serving_models = OpenAIServingModels(served_model_names, engine.max_model_len, engine, lora_modules,
                                         vision=engine.vision is not None)
    serving_completion = OpenAIServingCompletion(engine, serving_models, server_metrics, max_n, log_requests)
    chat_prompts = ChatPromptRenderer(engine)  # one renderer: /tokenize counts what chat runs
    check_reasoning_parser(reasoning_parser)
    serving_chat = OpenAIServingChat(engine, serving_models, server_metrics, max_n, log_requests,
                                     renderer=chat_prompts, reasoning_parser=reasoning_parser)
    serving_tokenization = OpenAIServingTokenization(engine.tokenizer, serving_models, chat_prompts)

    app = FastAPI(title="qwenserve")
    # the last added runs first: request id and access log, the Host check, the UI's headers, then CORS (preflights
    # need no key), the key, the size
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, metrics_public=metrics_public)
    if allowed_origins:
        app.add_middleware(OpenAICORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(UISecurityHeadersMiddleware, is_ui_path=is_ui_path)
    if is_loopback(host) or allowed_hosts:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=allowed_hosts or [])
    app.add_middleware(RequestContextMiddleware)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, e: EngineDeadError):  # e.g. a worker process died: this server cannot recover
        return error_response(503, str(e), "server_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is ("body", character offset): not a field
            reason = first.get("ctx", {}).get("error", "JSON decode error")
            return error_response(400, f"the body is not valid JSON: {reason} at character {first['loc'][-1]}",
                                  "invalid_request_error")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, "invalid_request_error", loc[0] if loc else None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        """Starlette's and FastAPI's own errors, in the OpenAI shape: unknown route, wrong method, a body that
        cannot be parsed (e.g. nested too deeply), a body too large."""
        if e.status_code == 404:
            message, code = f"Invalid URL ({request.method} {request.url.path})", "not_found"
        elif e.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
            allowed = (e.headers or {}).get("Allow")
            message, code = message + (f" (allowed: {allowed})" if allowed else ""), "method_not_allowed"
        elif e.status_code == 413:
            message, code = e.detail, "request_too_large"
        elif isinstance(e.__cause__, RecursionError):  # FastAPI says only "There was an error parsing the body"
            message, code = "the JSON body is nested too deeply", None
        elif isinstance(e.__cause__, UnicodeDecodeError):
            message, code = "the body is not UTF-8 encoded JSON", None
        else:
            message, code = e.detail if isinstance(e.detail, str) else "invalid request", None
        return error_response(e.status_code, message, "invalid_request_error", code=code, headers=e.headers)

    @app.get("/health")
    async def health():
        if engine.draining:  # a load balancer stops sending here while the live requests finish
            return error_response(503, "the server is shutting down", "server_error")
        if not engine.alive:
            return error_response(503, "the engine is not running", "server_error")
        if not engine.healthy:
            return error_response(503, f"the last {engine.consecutive_failed_steps} engine steps failed",
                                  "server_error")
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

    if allow_runtime_lora_updating and engine.lora_config.enable_lora:
        logger.warning("LoRA adapters may be loaded and unloaded while serving (/v1/load_lora_adapter, "
                       "/v1/unload_lora_adapter): whoever holds the API key can make the server read any adapter "
                       "directory it can reach")

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            return Response(await serving_models.load_lora_adapter(body.lora_name, body.lora_path),
                            media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            return Response(await serving_models.unload_lora_adapter(body.lora_name), media_type="text/plain")
    elif allow_runtime_lora_updating:
        logger.warning("--allow-runtime-lora-updating is ignored: the engine was started without --enable-lora")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await serving_tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving_tokenization.detokenize(body)

    @app.get("/", include_in_schema=False)
    async def web_ui():
        return FileResponse(WEBUI_DIR / "index.html")

    app.mount("/ui", StaticFiles(directory=WEBUI_DIR), name="ui")
    return app

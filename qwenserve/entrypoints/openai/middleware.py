"""The server's ASGI middleware: the request id and the access log (with the last-resort 500), the Host header's
check, the limit on request-body size, CORS with OpenAI-shaped refusals, and the web UI's security headers. Plain
ASGI rather than Starlette's BaseHTTPMiddleware, which would hide client disconnects from the routes and buffer
streamed responses."""
from __future__ import annotations

import ipaddress
import logging
import re
import time
import uuid
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from qwenserve.entrypoints.openai.serving_engine import ClientDisconnected, error_response

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("qwenserve.access")

REQUEST_ID_HEADER = b"x-request-id"
# a client's id is used as given when it is short and plain (it goes into logs and engine request ids)
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:+=-]{1,128}")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client left before the response was complete


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def request_id_of(scope) -> tuple[str, bool]:
    """(the client's X-Request-Id if it is usable, else a new one; whether it is the client's)."""
    given = (_header(scope, REQUEST_ID_HEADER) or b"").decode("latin-1")
    return (given, True) if _CLIENT_REQUEST_ID.fullmatch(given) else (uuid.uuid4().hex, False)


class RequestContextMiddleware:
    """Outermost. Gives each HTTP request an id (scope["state"]["request_id"], and ["request_id_from_client"]
    saying whether the client chose it; returned as X-Request-Id), turns any exception the app lets out into an
    OpenAI-shaped 500 (the traceback goes to the log, never to the client), and writes one line per request on
    the "qwenserve.access" logger: id, method, path, status, prompt and output tokens (as the route left them in
    scope["state"]["usage"]), latency. A client that left early is one INFO line with status 499, not a
    traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id, from_client = request_id_of(scope)
        state = scope.setdefault("state", {})
        state["request_id"], state["request_id_from_client"] = request_id, from_client
        status, complete, disconnected = None, False, False

        async def watched_receive():
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                disconnected = True
            return message

        async def send_with_id(message):
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID_HEADER, request_id.encode())]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, watched_receive, send_with_id)
        except (ClientDisconnected, ClientDisconnect):
            disconnected = True
        except Exception:  # noqa: BLE001 - the last resort: log it here, answer without any detail
            logger.exception("request %s failed", request_id)
            if status is None:
                response = error_response(500, f"internal server error (request id {request_id})", "server_error")
                await response(scope, watched_receive, send_with_id)
        finally:
            left_early = disconnected and not complete
            self._log(scope, request_id, CLIENT_CLOSED_REQUEST if left_early else status, state.get("usage") or {},
                      time.perf_counter() - start, left_early)

    @staticmethod
    def _log(scope, request_id: str, status: int | None, usage: dict, seconds: float, disconnected: bool) -> None:
        fields = {"request_id": request_id, "method": scope["method"], "path": scope["path"], "status": status,
                  "prompt_tokens": usage.get("prompt_tokens"), "output_tokens": usage.get("completion_tokens"),
                  "latency_ms": round(seconds * 1000, 1)}
        line = " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())
        access_logger.info(line + (" client disconnected" if disconnected else ""),
                           extra=fields | {"disconnected": disconnected})


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether `host` (a listening address, or a Host header's name without its port) is this machine's loopback:
    localhost, 127.x.x.x or ::1 (bracketed or not)."""
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """A Host header's name without its port: "example.com:8000" -> "example.com", "[::1]:8000" -> "[::1]"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[:header.find("]") + 1] if "]" in header else header
    return (header.rsplit(":", 1)[0] if header.count(":") == 1 else header).rstrip(".")


class HostCheckMiddleware:
    """Answers only requests whose Host header names this server: a loopback name (localhost, 127.0.0.1, [::1],
    any port) or one of `allowed_hosts` ("*" for any); the others get 421. A page on another site can point its
    own name at 127.0.0.1 (DNS rebinding) and then call a server on loopback from the user's browser as if it
    were its own origin, past CORS; the browser still sends that site's name as the Host, which is refused here.
    A request without a Host header (HTTP/1.0) is answered: browsers always send one."""

    def __init__(self, app, allowed_hosts: list[str] = ()):
        self.app = app
        self.allowed = {host_name(h) for h in allowed_hosts}

    def allows(self, header: str) -> bool:
        name = host_name(header)
        return "*" in self.allowed or is_loopback(name) or name in self.allowed

    async def __call__(self, scope, receive, send):
        header = _header(scope, b"host") if scope["type"] == "http" else None
        if header is not None and not self.allows(header.decode("latin-1")):
            names = ", ".join([*LOOPBACK_NAMES, *sorted(self.allowed)])
            shown = header.decode("latin-1")[:100]
            await error_response(421, f"the Host header {shown!r} is not a name of this server, which answers "
                                      f"only {names} (any port); --allowed-hosts adds names",
                                 "invalid_request_error", code="invalid_host")(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestTooLarge(HTTPException):
    """An HTTPException, so that FastAPI's body reader passes it on as it is (it turns other errors raised while
    reading into a 400) and the app's HTTPException handler answers it."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is larger than this server accepts ({max_bytes} bytes; "
                              "--max-request-bytes)")


class BodySizeLimitMiddleware:
    """Refuses a body over max_bytes with 413: at once when its Content-Length says so (nothing of it is read),
    else as soon as the bytes received pass the limit (a chunked upload is never read whole)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except RequestTooLarge:
            if started:  # a route that read its body after answering: nothing more can be said
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        e = RequestTooLarge(self.max_bytes)
        await error_response(e.status_code, e.detail, "invalid_request_error", code="request_too_large",
                             headers={"Connection": "close"})(scope, receive, send)


class OpenAICORSMiddleware(CORSMiddleware):
    """Starlette's CORS, but a refused preflight says why in the OpenAI error shape, not in plain text."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        cors_headers = {k: v for k, v in response.headers.items() if k.startswith("access-control-") or k == "vary"}
        return error_response(response.status_code, response.body.decode(), "invalid_request_error",
                              code="cors_refused", headers=cors_headers)


# The web UI holds the user's API key and shows text an attacker can steer (the model's answers), so its pages may
# run only the server's own script files (no inline script, no eval), load images only from the server or the
# page's own data, embed no plugins, change no base URL, post forms only to the server, and be framed by no page.
UI_CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'", "script-src 'self'", "img-src 'self' data: blob:", "object-src 'none'",
    "base-uri 'none'", "frame-ancestors 'none'", "form-action 'self'",
])
UI_SECURITY_HEADERS = [
    (b"content-security-policy", UI_CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),  # a file is run or styled only as the type it is served as
    (b"referrer-policy", b"no-referrer"),     # a link followed from an answer does not tell where it came from
    # nor does pointing at one: the browser resolves no link's host before it is followed (a host name can carry
    # what an answer was steered to leak, and its DNS lookup would send that out)
    (b"x-dns-prefetch-control", b"off"),
]


class UISecurityHeadersMiddleware:
    """Adds UI_SECURITY_HEADERS (replacing any the app set) to every response on a path is_ui_path accepts,
    errors included."""

    def __init__(self, app, is_ui_path: Callable[[str], bool]):
        self.app = app
        self.is_ui_path = is_ui_path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.is_ui_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        names = {name for name, _ in UI_SECURITY_HEADERS}

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() not in names]
                message = {**message, "headers": kept + UI_SECURITY_HEADERS}
            await send(message)

        await self.app(scope, receive, send_with_headers)

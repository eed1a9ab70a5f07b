"""`qwenserve serve`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import logging
import os

from qwenserve.config.engine_config import parse_size
from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args, positive_int

API_KEY_ENV = "QWENSERVE_API_KEY"
DEFAULT_MAX_N = 128  # serving_engine.DEFAULT_MAX_N (not imported here: that would load the server at CLI start)
DEFAULT_MAX_REQUEST_BYTES = "4MiB"  # api_server.DEFAULT_MAX_REQUEST_BYTES
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0  # graceful_shutdown.DEFAULT_SHUTDOWN_TIMEOUT_S (why 20 is said there)


def byte_size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 4MiB, 1048576)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text!r}")
    return value


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model ids clients may ask for (default: the model's id)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health, the web UI's files and "
                        f"(with --metrics-public) /metrics; default: ${API_KEY_ENV} if set, else no key")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins allowed to call the API (CORS), e.g. https://app.example.com; "
                        "default: none (CORS off)")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM); needs --ssl-certfile")
    p.add_argument("--ssl-certfile", default=None, help="the certificate (PEM) for --ssl-keyfile")
    p.add_argument("--max-waiting-requests", type=positive_int, default=1024,
                   help="requests queued beyond the running batch before new ones get 503 (default: %(default)s)")
    p.add_argument("--max-n", type=positive_int, default=DEFAULT_MAX_N,
                   help="largest n (samples per prompt) a request may ask for; more is a 400 (default: %(default)s, "
                        "the OpenAI API's own limit)")
    p.add_argument("--max-request-bytes", type=byte_size, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted; a larger one is a 413, refused before it is read "
                        "(default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM or Ctrl-C, new requests get 503 while the running ones may finish for this many "
                        "seconds; those still running then end with an error, and the server exits 0 (default: "
                        "%(default)s; fits Kubernetes' 30 s grace period)")
    p.add_argument("--log-requests", action="store_true",
                   help="log each request's prompt, parameters and outputs (never logged otherwise)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from qwenserve.engine.async_engine import AsyncLLMEngine
    from qwenserve.engine.data_parallel import build_engine
    from qwenserve.entrypoints.openai.api_server import build_app
    from qwenserve.entrypoints.openai.graceful_shutdown import GracefulServer

    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both, or neither")
    engine = AsyncLLMEngine(build_engine(engine_config_from_args(args)),
                            max_waiting_requests=args.max_waiting_requests)
    names = args.served_model_name or [engine.model_id]
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    app = build_app(engine, names, api_key, max_n=args.max_n, max_request_bytes=args.max_request_bytes,
                    allowed_origins=args.allowed_origins, metrics_public=args.metrics_public,
                    log_requests=args.log_requests)
    scheme = "https" if args.ssl_certfile else "http"
    log = logging.getLogger("qwenserve")
    log.info("serving %s at %s://%s:%d/v1", ", ".join(names), scheme, args.host, args.port)
    if not api_key:
        log.warning("no API key (--api-key or $%s): every route is open to whoever can reach %s:%d", API_KEY_ENV,
                    args.host, args.port)
    try:
        # uvicorn's access log is off: qwenserve.access writes one line per request, with its id and tokens
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False,
                                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
        GracefulServer(config, engine, args.shutdown_timeout).run()
    finally:
        engine.shutdown()
    return 0

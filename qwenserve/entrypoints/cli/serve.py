"""`qwenserve serve`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import logging

from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args, positive_int


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model ids clients may ask for (default: the model's id)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health, /metrics)")
    p.add_argument("--max-waiting-requests", type=positive_int, default=1024,
                   help="requests queued beyond the running batch before new ones get 503 (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from qwenserve.engine.async_engine import AsyncLLMEngine
    from qwenserve.engine.llm_engine import LLMEngine
    from qwenserve.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine(LLMEngine(engine_config_from_args(args)), max_waiting_requests=args.max_waiting_requests)
    names = args.served_model_name or [engine.model_id]
    app = build_app(engine, names, args.api_key)
    logging.getLogger("qwenserve").info("serving %s at http://%s:%d/v1", ", ".join(names), args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.shutdown()
    return 0

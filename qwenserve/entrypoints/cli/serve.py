"""`qwenserve serve`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from qwenserve.config.environment import env_defaults
from qwenserve.config.errors import ConfigError
from qwenserve.config.server_config import API_KEY_ENV, ServerConfig
from qwenserve.entrypoints.cli.engine_args import add_engine_args, add_setting_flag, engine_config_from_args
from qwenserve.entrypoints.openai.reasoning import check_reasoning_parser


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    group = p.add_argument_group("server arguments")
    for f in dataclasses.fields(ServerConfig):
        add_setting_flag(group, f)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server's settings from the parsed flags, with the environment's defaults for those not given."""
    fields = dataclasses.fields(ServerConfig)
    given = {f.name: getattr(args, f.name) for f in fields if hasattr(args, f.name)}
    from_env = env_defaults(fields, given.keys())
    return ServerConfig(**given, **{name: found.value for name, found in from_env.items()})


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from qwenserve.engine.async_engine import AsyncLLMEngine
    from qwenserve.engine.data_parallel import build_engine
    from qwenserve.entrypoints.openai.api_server import build_app
    from qwenserve.entrypoints.openai.graceful_shutdown import GracefulServer

    server = server_config_from_args(args)  # before the model loads: a bad server setting fails at once
    check_reasoning_parser(server.reasoning_parser)
    engine_config = engine_config_from_args(args)
    if server.lora_modules and not engine_config.lora.enable_lora:
        raise ConfigError(f"--lora-modules {' '.join(m.name for m in server.lora_modules)} needs --enable-lora")
    engine = AsyncLLMEngine(build_engine(engine_config), max_waiting_requests=server.max_waiting_requests)
    try:
        names = server.served_model_name or [engine.model_id]
        api_key = server.api_key or os.environ.get(API_KEY_ENV) or None
        app = build_app(engine, names, api_key, max_n=server.max_n, max_request_bytes=server.max_request_bytes,
                        allowed_origins=server.allowed_origins, metrics_public=server.metrics_public,
                        log_requests=server.log_requests, lora_modules=server.lora_modules,
                        allow_runtime_lora_updating=server.allow_runtime_lora_updating,
                        reasoning_parser=server.reasoning_parser, host=server.host,
                        allowed_hosts=server.allowed_hosts)
        scheme = "https" if server.ssl_certfile else "http"
        log = logging.getLogger("qwenserve")
        log.info("serving %s at %s://%s:%d/v1", ", ".join(names + [m.name for m in server.lora_modules]), scheme,
                 server.host, server.port)
        if not api_key:
            log.warning("no API key (--api-key or $%s): every route is open to whoever can reach %s:%d",
                        API_KEY_ENV, server.host, server.port)
        # uvicorn's access log is off: qwenserve.access writes one line per request, with its id and tokens
        config = uvicorn.Config(app, host=server.host, port=server.port, log_level="info", access_log=False,
                                ssl_keyfile=server.ssl_keyfile, ssl_certfile=server.ssl_certfile)
        GracefulServer(config, engine, server.shutdown_timeout).run()
    finally:
        engine.shutdown()
    return 0

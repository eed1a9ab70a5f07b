"""Settings of the OpenAI-compatible server (`qwenserve serve`), declared once: the serve command's flags are
generated from these fields, and the server, its graceful shutdown and `bench serve` take their defaults from
them."""
from __future__ import annotations

import json
from dataclasses import dataclass

from qwenserve.config.engine_config import parse_size, setting
from qwenserve.config.errors import ConfigError

API_KEY_ENV = "QWENSERVE_API_KEY"  # read by the serve command itself, when --api-key is not given


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter served from the start (--lora-modules): clients ask for it by `name` as their `model`."""
    name: str
    path: str
    base_model_name: str | None = None  # the model it was trained on, listed as its parent (default: ours)


def parse_lora_module(text: str) -> LoRAModulePath:
    """One --lora-modules value, as vLLM takes it: name=path, or JSON {"name": ..., "path": ...,
    "base_model_name": ...}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"lora_modules value {text!r} is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ConfigError(f"lora_modules value {text!r} is not a JSON object")
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        if unknown:
            raise ConfigError(f"lora_modules value {text!r} has unknown keys {unknown}; the keys are name, path "
                              f"and base_model_name")
        name, path, base = spec.get("name"), spec.get("path"), spec.get("base_model_name")
        if base is not None and (not isinstance(base, str) or not base):
            raise ConfigError(f"lora_modules value {text!r}: base_model_name must be a non-empty string")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ConfigError(f"lora_modules value {text!r} is neither name=path nor JSON such as "
                              f'{{"name": "sql", "path": "/adapters/sql"}}')
        base = None
    for key, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"lora_modules value {text!r} has no {key}")
    return LoRAModulePath(name.strip(), path.strip(), base)


@dataclass(frozen=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on (default: %(default)s)")
    port: int = setting(8000, "port to listen on (default: %(default)s)", type=int)
    served_model_name: list[str] | None = setting(None, "model ids clients may ask for (default: the model's id)",
                                                  nargs="+")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' on every route but /health, the web UI's "
                                        f"files and (with --metrics-public) /metrics; default: ${API_KEY_ENV} if "
                                        "set, else no key")
    metrics_public: bool = setting(False, "serve /metrics without the API key (default: off)")
    allowed_origins: list[str] | None = setting(None, "browser origins allowed to call the API (CORS), e.g. "
                                                      "https://app.example.com; default: none (CORS off)",
                                                nargs="+", metavar="ORIGIN")
    allowed_hosts: list[str] | None = setting(None, "Host header names the server answers besides the loopback ones "
                                                    "(localhost, 127.0.0.1, [::1]; any port), e.g. api.example.com, "
                                                    "or * for any; default: only those on a loopback --host, any "
                                                    "elsewhere", nargs="+", metavar="HOST")
    ssl_keyfile: str | None = setting(None, "serve HTTPS with this private key (PEM); needs --ssl-certfile")
    ssl_certfile: str | None = setting(None, "the certificate (PEM) for --ssl-keyfile")
    max_waiting_requests: int = setting(1024, "requests queued beyond the running batch before new ones get 503 "
                                              "(default: %(default)s)", type=int)
    # OpenAI's own upper bound on n; also well under the default max_num_seqs (256), so one request cannot fill
    # the batch
    max_n: int = setting(128, "largest n (samples per prompt) a request may ask for; more is a 400 (default: "
                              "%(default)s, the OpenAI API's own limit)", type=int)
    # a full 128k-token context as JSON token ids is ~1 MB; bodies of gigabytes are not requests
    max_request_bytes: int | str = setting("4MiB", "largest request body accepted; a larger one is a 413, refused "
                                                   "before it is read (default: %(default)s)")
    # Kubernetes sends SIGKILL 30 s after SIGTERM by default: 20 s of draining leaves time within that for the
    # abort, the connections' grace and stopping the engine and its workers, so a pod's requests end with an
    # error, not a reset
    shutdown_timeout: float = setting(20.0, "on SIGTERM or Ctrl-C, new requests get 503 while the running ones may "
                                            "finish for this many seconds; those still running then end with an "
                                            "error, and the server exits 0 (default: %(default)s; fits Kubernetes' "
                                            "30 s grace period)", type=float)
    reasoning_parser: str | None = setting(None, "split a thinking model's answer: the text between <think> and "
                                                 "</think> as the message's reasoning_content, the rest as its "
                                                 "content; qwen3 or deepseek_r1 (vLLM's names; default: none)")
    log_requests: bool = setting(False, "log each request's prompt, parameters and outputs (never logged otherwise)")
    lora_modules: list[str] | tuple[LoRAModulePath, ...] | None = setting(
        None, "LoRA adapters served from the start (needs --enable-lora), each name=path or JSON such as "
              "'{\"name\": \"sql\", \"path\": \"/adapters/sql\", \"base_model_name\": \"qwen\"}'; a client "
              "asks for one by its name as `model`", nargs="+", metavar="LORA_MODULE")
    allow_runtime_lora_updating: bool = setting(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora), so adapters can be "
               "added and removed while serving (default: off)", env="QWENSERVE_ALLOW_RUNTIME_LORA_UPDATING")

    def __post_init__(self):
        modules = tuple(m if isinstance(m, LoRAModulePath) else parse_lora_module(m) for m in self.lora_modules or ())
        names = [m.name for m in modules]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(f"lora_modules names {repeated} more than once: each adapter needs its own name")
        object.__setattr__(self, "lora_modules", modules)
        object.__setattr__(self, "max_request_bytes", parse_size(self.max_request_bytes, "max_request_bytes"))
        for name in ("max_waiting_requests", "max_n", "max_request_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be between 0 (any free one) and 65535, got {self.port}")
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"shutdown_timeout must be 0 or more seconds, got {self.shutdown_timeout!r}")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ConfigError("ssl_keyfile and ssl_certfile go together (--ssl-keyfile, --ssl-certfile): give both, "
                              "or neither")


SERVER_DEFAULTS = ServerConfig()

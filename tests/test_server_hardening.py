"""The server in front of untrusted clients: bounded fan-out, OpenAI-shaped errors for
everything, one access line per request and no tracebacks for disconnects, prompts kept out of the logs, the API
key, CORS and TLS. Live servers on loopback ports, driven by the openai client, httpx and raw sockets."""
import asyncio
import logging
import os
import re
import socket
import time

import httpx
import openai
import pytest

from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.async_engine import AsyncLLMEngine, OverloadedError
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.openai.api_server import build_app
from qwenserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from qwenserve.entrypoints.openai.serving_engine import OpenAIServing
from qwenserve.sample.sampling_params import SamplingParams

from helpers import (hold_engine_thread, live_server, save_hf_dir, self_signed_cert, serve_process, tiny_hf_model,
                     wait_idle_and_clean)

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_N = 100
MAX_NUM_SEQS = 64
MAX_REQUEST_BYTES = 64 * 1024
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_hf_dir(tiny_hf_model(seed=71, max_position_embeddings=256), str(tmp_path_factory.mktemp("hard")))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(
        model=model_dir, dtype="float32", kv_cache_memory="2MiB", max_num_seqs=MAX_NUM_SEQS)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    app = build_app(engine, ["tiny"], api_key=KEY, max_n=MAX_N, max_request_bytes=MAX_REQUEST_BYTES)
    with live_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def access_records(caplog, request_id: str | None = None, count: int = 1) -> list[logging.LogRecord]:
    """The access lines (of one request id), once there are `count` of them: a line is written when the response
    is done, which can be just after the client has read it."""
    deadline = time.time() + 5
    while True:
        found = [r for r in caplog.records if r.name == "qwenserve.access"
                 and (request_id is None or r.request_id == request_id)]
        if len(found) >= count or time.time() > deadline:
            return found
        time.sleep(0.02)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    """The status, the exact OpenAI error shape, a request id, and nothing of the server's insides."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert response.headers["x-request-id"]
    assert "Traceback" not in response.text and ".py" not in response.text
    return body["error"]


# ---- 1. admission ------------------------------------------------------------------------------------------

def test_fan_out_beyond_the_limits_is_a_400_naming_the_limit(client, url, engine):
    kv_tokens = engine.kv_cache_tokens
    assert kv_tokens == 4096  # 2 MiB / (2 layers x k,v x 2 kv heads x 16 dims x 4 bytes)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", n=100000)
    assert e.value.param == "n" and f"n must be at most {MAX_N}" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=100000)
    assert e.value.param == "n" and "--max-n" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # under --max-n, over the batch
        client.completions.create(model="tiny", prompt="x", n=80)
    assert e.value.param == "n"
    assert f"n=80 samples of one prompt are more than the {MAX_NUM_SEQS}" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # fits the batch, never the KV cache: 1 + 40 x 200 tokens
        client.completions.create(model="tiny", prompt="x", n=40, max_tokens=200)
    assert e.value.param == "n"
    assert (f"1 prompt tokens + n=40 x 200 max_tokens = 8001 tokens, and the whole cache holds {kv_tokens}"
            in e.value.body["message"])
    wait_idle_and_clean(engine)  # none of them was queued
    ok = client.completions.create(model="tiny", prompt="x", n=40, max_tokens=8, extra_body=GREEDY)
    assert len(ok.choices) == 40 and ok.usage.completion_tokens == 40 * 8
    # each prompt of a batch is its own request: 2 x 40 samples together exceed the batch, and queue
    ok = client.completions.create(model="tiny", prompt=["x", "y"], n=40, max_tokens=4, extra_body=GREEDY)
    assert len(ok.choices) == 80 and ok.usage.completion_tokens == 80 * 4
    wait_idle_and_clean(engine)


def test_max_tokens_beyond_the_context_says_so_as_vllm_does(client, url):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=1000)
    prompt_tokens = httpx.post(url + "/tokenize", json={"messages": messages}, headers=AUTH).json()["count"]
    assert e.value.param == "max_tokens"
    assert e.value.body["message"] == (
        f"This model's maximum context length is 256 tokens. However, you requested {prompt_tokens + 1000} tokens "
        f"({prompt_tokens} in the messages, 1000 in the completion). Please reduce the length of the messages or "
        "completion.")
    with pytest.raises(openai.BadRequestError) as e:  # the prompt alone is too long: say that instead
        client.completions.create(model="tiny", prompt=list(range(1, 301)), max_tokens=1)
    assert e.value.param == "prompt"
    assert "maximum context length is 256 tokens. However, your request has 300 input tokens" in e.value.body["message"]


def test_waiting_limit_counts_requests_not_their_samples(model_dir):
    """Two requests may wait. X (n=2) and Y's first sample fill three of the four seats; Y's other three samples
    fork with one seat left, so two of them wait: two waiting sequences, but one waiting request. Z must still get
    in (counting sequences refused it); a fourth request then finds two requests waiting and gets 503."""
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=model_dir, dtype="float32",
                                                               kv_cache_memory="2MiB", max_num_seqs=4)),
                            max_waiting_requests=2)

    async def main():
        params = lambda n: SamplingParams(n=n, max_tokens=200, temperature=0, ignore_eos=True)  # noqa: E731
        x = await engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, params(2))
        await x.get()  # X's prompt ran and both its samples run
        y = await engine.add_request("y", {"prompt_token_ids": [8, 9]}, params(4))
        await y.get()  # Y's prompt ran; its samples forked
        waiting = await engine.call(lambda e: len(e.scheduler.waiting))
        await engine.add_request("z", {"prompt_token_ids": [10]}, params(1))
        with pytest.raises(OverloadedError, match="2 requests are already waiting"):
            await engine.add_request("w", {"prompt_token_ids": [11]}, params(1))
        for rid in ("x", "y", "z"):
            engine.abort(rid)
        await engine.call(lambda e: None)  # the aborts are handled: nothing is delivered to this closing loop
        return waiting
    try:
        assert asyncio.run(main()) == 2
        wait_idle_and_clean(engine)
    finally:
        engine.shutdown()


# ---- 2. errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,path,content,status,message", [
    ("POST", "/v1/completions", b'{"prompt": "x"', 400, "the body is not valid JSON"),
    ("POST", "/v1/completions", b"[" * 50_000, 400, "nested too deeply"),
    ("POST", "/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
    ("POST", "/v1/completions", b'{"prompt": "\xff"}', 400, "not UTF-8"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "valid dictionary"),
    ("GET", "/v1/no-such-route", None, 404, "Invalid URL (GET /v1/no-such-route)"),
    ("GET", "/v1/completions", None, 405, "Method GET is not allowed for /v1/completions"),
    ("POST", "/v1/completions", b" " * (MAX_REQUEST_BYTES + 1), 413, "larger than this server accepts (65536"),
])
def test_every_error_is_openai_shaped(url, engine, method, path, content, status, message):
    headers = AUTH | {"content-type": "application/json"}
    error = assert_openai_error(httpx.request(method, url + path, content=content, headers=headers), status)
    assert message in error["message"]


def test_a_body_over_the_limit_is_refused_before_it_is_read(url):
    """A raw socket: a declared size far over the limit is refused at once, with only the headers sent; a chunked
    upload is refused as soon as it passes the limit, while the client is still sending."""
    host, port = url.removeprefix("http://").split(":")

    def exchange(head: bytes, body_parts: list[bytes]) -> bytes:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(head)
            for part in body_parts:
                s.sendall(part)
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            return data

    start = time.time()
    answer = exchange(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {10 ** 12}\r\n\r\n".encode(), [b'{"pro'])
    assert answer.startswith(b"HTTP/1.1 413") and b'"code":"request_too_large"' in answer
    assert time.time() - start < 5
    chunk = b" " * 16384
    answer = exchange(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
                      "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode(),
                      [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 5)  # 80 KiB, never terminated
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer


def test_an_unexpected_exception_is_a_bare_500(url, monkeypatch, caplog):
    def broken(self, prompt):
        raise RuntimeError("failed reading /srv/secret/path/tokenizer.json")
    monkeypatch.setattr(OpenAIServingCompletion, "_tokenized", broken)
    with caplog.at_level(logging.ERROR):
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers=AUTH | {"X-Request-Id": "boom-1"})
    error = assert_openai_error(r, 500)
    assert error["type"] == "server_error" and "boom-1" in error["message"] and "secret" not in r.text
    logged = [rec for rec in caplog.records if rec.exc_info]
    assert len(logged) == 1 and "/srv/secret/path" in caplog.text  # the log has it all, once


# ---- 3. logs -----------------------------------------------------------------------------------------------

def test_one_access_line_per_request_with_its_id_and_tokens(client, url, caplog):
    with caplog.at_level(logging.INFO):  # kept until the lines are in: they may come after the responses
        r = httpx.post(url + "/v1/completions", headers=AUTH | {"X-Request-Id": "trace-42.a"},
                       json={"prompt": "hello", "max_tokens": 7} | GREEDY)
        generated = httpx.get(url + "/health")
        refused = httpx.post(url + "/v1/completions", json={"prompt": "x"},
                             headers={"X-Request-Id": "bad id with spaces"})
        ids = {"trace-42.a", generated.headers["x-request-id"], refused.headers["x-request-id"]}
        for rid in ids:  # one line each, errors too (an earlier test's line may come in late: not counted)
            assert len(access_records(caplog, rid)) == 1
    assert r.headers["x-request-id"] == "trace-42.a" and r.json()["id"] == "cmpl-trace-42.a"
    [line] = access_records(caplog, "trace-42.a")
    usage = r.json()["usage"]
    assert line.levelno == logging.INFO and (line.method, line.path, line.status) == ("POST", "/v1/completions", 200)
    assert (line.prompt_tokens, line.output_tokens) == (usage["prompt_tokens"], 7) and line.latency_ms > 0
    assert re.fullmatch(r"request_id=trace-42\.a method=POST path=/v1/completions status=200 prompt_tokens=\d+ "
                        r"output_tokens=7 latency_ms=[\d.]+", line.getMessage())
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])  # made when the client sent none
    assert refused.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])


def test_a_reused_request_id_does_not_collide_in_the_engine(url, engine):
    """Proxies retry with the same X-Request-Id, maybe while the first try is still being aborted."""
    async def main():
        async with httpx.AsyncClient(base_url=url, headers=AUTH | {"X-Request-Id": "same"}, timeout=30) as c:
            body = {"prompt": "twice", "max_tokens": 6} | GREEDY
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(2)])
    first, second = asyncio.run(main())
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert first.json()["id"] == second.json()["id"] == "cmpl-same" and second.headers["x-request-id"] == "same"
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    wait_idle_and_clean(engine)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_disconnect_is_one_info_line(url, engine, caplog, monkeypatch, stream):
    monkeypatch.setattr(OpenAIServing, "DISCONNECT_POLL_S", 0.02)
    body = {"prompt": "go on", "max_tokens": 240, "stream": stream} | GREEDY
    headers = AUTH | {"X-Request-Id": f"leaver-{stream}"}
    with caplog.at_level(logging.DEBUG):
        if stream:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))  # leave after the first chunk
        else:  # the engine is held mid-step until the client has given up, so the request runs only after that
            with hold_engine_thread(engine), pytest.raises(httpx.TimeoutException):
                httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=0.1)
        wait_idle_and_clean(engine)
        [line] = access_records(caplog, headers["X-Request-Id"])
    assert line.levelno == logging.INFO and line.status == 499 and line.getMessage().endswith("client disconnected")
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.WARNING]
    assert "Traceback" not in caplog.text and "CancelledError" not in caplog.text


def test_prompts_and_outputs_are_logged_only_with_log_requests(url, engine, caplog):
    body = {"prompt": "zebra secret 7", "max_tokens": 4} | GREEDY
    with caplog.at_level(logging.DEBUG):
        text = httpx.post(url + "/v1/completions", json=body, headers=AUTH).json()["choices"][0]["text"]
    assert "zebra" not in caplog.text and not [r for r in caplog.records if r.name == "qwenserve.requests"]
    caplog.clear()

    async def with_log_requests():
        app = build_app(engine, ["tiny"], log_requests=True)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            return (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    with caplog.at_level(logging.INFO, logger="qwenserve.requests"):
        assert asyncio.run(with_log_requests()) == text
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "qwenserve.requests")
    assert "zebra secret 7" in logged and repr([text]) in logged


# ---- 7. security defaults ----------------------------------------------------------------------------------

def test_the_key_guards_every_route_but_health_and_the_ui(url, engine):
    for path in ("/v1/models", "/metrics", "/v1/no-such-route"):
        error = assert_openai_error(httpx.get(url + path), 401)
        assert error["type"] == "authentication_error"
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/tokenize").status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/").status_code == 200  # the web UI's page: its API calls carry the key
    assert httpx.get(url + "/metrics", headers=AUTH).status_code == 200

    async def metrics_public():
        app = build_app(engine, ["tiny"], api_key=KEY, metrics_public=True)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            return (await c.get("/metrics")).status_code, (await c.get("/v1/models")).status_code
    assert asyncio.run(metrics_public()) == (200, 401)


def test_cors_is_off_unless_origins_are_allowed(url, engine):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(url + "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(url + "/v1/models", headers=AUTH | {"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers

    async def allowed():
        app = build_app(engine, ["tiny"], api_key=KEY, allowed_origins=["https://app.example"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            ok = await c.options("/v1/completions", headers=preflight)  # answered before the key is asked for
            other = await c.options("/v1/completions", headers=preflight | {"Origin": "https://evil.example"})
            get = await c.get("/v1/models", headers=AUTH | {"Origin": "https://app.example"})
            return ok, other, get
    ok, other, get = asyncio.run(allowed())
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-origin" not in other.headers
    assert assert_openai_error(other, 400)["message"] == "Disallowed CORS origin"
    assert get.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in get.headers["access-control-expose-headers"].lower()


def test_a_loopback_server_answers_only_loopback_host_names(url, engine):
    """DNS rebinding: a page on another site points its name at 127.0.0.1 and calls the server from the user's
    browser as its own origin. Listening on loopback (the default), the server answers only the loopback names;
    elsewhere (0.0.0.0, a LAN address) any name, unless --allowed-hosts names some."""
    port = url.rsplit(":", 1)[1]
    for host in ("rebind.evil.example", f"rebind.evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io",
                 f"[::2]:{port}", "x"):
        error = assert_openai_error(httpx.get(url + "/v1/models", headers=AUTH | {"Host": host}), 421)
        assert error["code"] == "invalid_host" and repr(host) in error["message"], host
        assert "localhost, 127.0.0.1, [::1]" in error["message"] and "--allowed-hosts" in error["message"]
        assert httpx.get(url + "/", headers={"Host": host}).status_code == 421  # the web UI too
    for host in ("localhost", f"localhost:{port}", "LOCALHOST.", f"127.0.0.1:{port}", "[::1]", f"[::1]:{port}",
                 "127.0.0.2"):
        assert httpx.get(url + "/v1/models", headers=AUTH | {"Host": host}).status_code == 200, host

    async def statuses(app, hosts):
        out = []
        for host in hosts:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}") as c:
                out.append((await c.get("/health")).status_code)
        return out
    hosts = ["rebind.evil.example", "api.example.com:8443", "localhost:1"]
    for listen in ("localhost", "::1"):
        assert asyncio.run(statuses(build_app(engine, ["tiny"], host=listen), hosts)) == [421, 421, 200]
    for listen in ("0.0.0.0", "192.168.1.20", "::"):  # remote clients name it as they reach it
        assert asyncio.run(statuses(build_app(engine, ["tiny"], host=listen), hosts)) == [200, 200, 200]
    allowed = build_app(engine, ["tiny"], host="0.0.0.0", allowed_hosts=["API.example.com"])
    assert asyncio.run(statuses(allowed, hosts)) == [421, 200, 200]
    behind_proxy = build_app(engine, ["tiny"], allowed_hosts=["*"])  # on loopback behind a proxy that passes its Host
    assert asyncio.run(statuses(behind_proxy, hosts)) == [200, 200, 200]


def test_serve_flags_are_the_server_configs_fields():
    from qwenserve.config.server_config import SERVER_DEFAULTS, ServerConfig
    from qwenserve.entrypoints.cli.main import build_parser
    from qwenserve.entrypoints.cli.serve import server_config_from_args
    parse = build_parser().parse_args
    assert server_config_from_args(parse(["serve"])) == ServerConfig()
    assert (SERVER_DEFAULTS.max_n, SERVER_DEFAULTS.max_request_bytes) == (128, 4 << 20)
    assert (SERVER_DEFAULTS.api_key, SERVER_DEFAULTS.allowed_origins, SERVER_DEFAULTS.allowed_hosts) == (None,) * 3
    assert not SERVER_DEFAULTS.metrics_public and not SERVER_DEFAULTS.log_requests
    given = server_config_from_args(parse(["serve", "--max-request-bytes", "1MiB", "--max-n", "4", "--port", "0",
                                           "--allowed-origins", "https://a.example", "https://b.example",
                                           "--allowed-hosts", "api.example.com", "10.0.0.5"]))
    assert (given.max_request_bytes, given.max_n, given.port) == (1 << 20, 4, 0)
    assert given.allowed_origins == ["https://a.example", "https://b.example"]
    assert given.allowed_hosts == ["api.example.com", "10.0.0.5"]


@pytest.mark.parametrize("flags, pattern", [
    (["--max-n", "0"], "max_n must be a positive integer, got 0"),
    (["--max-request-bytes", "lots"], "max_request_bytes 'lots' is not a size"),
    (["--shutdown-timeout", "-1"], "shutdown_timeout must be 0 or more seconds"),
    (["--ssl-keyfile", "key.pem"], "ssl_keyfile and ssl_certfile go together"),
])
def test_bad_server_settings_are_named(flags, pattern):
    from qwenserve.config.errors import ConfigError
    from qwenserve.entrypoints.cli.main import build_parser
    from qwenserve.entrypoints.cli.serve import server_config_from_args
    with pytest.raises(ConfigError, match=pattern):
        server_config_from_args(build_parser().parse_args(["serve", *flags]))


@pytest.mark.multiproc
def test_serve_command_tls_env_key_and_quiet_logs(model_dir, tmp_path):
    """`qwenserve serve` as users start it: HTTPS with a self-signed certificate, the key from
    QWENSERVE_API_KEY, CORS for one origin, the Host check of a loopback address; its log has our access lines,
    not uvicorn's, and a client that leaves mid-stream is one INFO line."""
    cert, key = self_signed_cert(tmp_path)
    log_path = tmp_path / "serve.log"
    env = os.environ | {"QWENSERVE_API_KEY": "env-key", "QWENSERVE_CPU_KERNELS": "0"}
    with serve_process(["--model", model_dir, "--dtype", "float32", "--kv-cache-memory", "2MiB",
                        "--served-model-name", "tiny", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                        "--allowed-origins", "https://app.example"], log_path, env, verify=str(cert)) as (proc, base):
        tls = openai.OpenAI(base_url=base + "/v1", api_key="env-key", max_retries=0,
                            http_client=openai.DefaultHttpxClient(verify=str(cert)))
        answer = tls.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "tls-zebra"}],
                                             max_tokens=3)
        assert answer.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError), openai.OpenAI(
                base_url=base + "/v1", api_key="wrong", max_retries=0,
                http_client=openai.DefaultHttpxClient(verify=str(cert))) as wrong_key:
            wrong_key.models.list()
        # on the default loopback --host, another site's name (DNS rebinding) is refused
        assert httpx.get(base + "/health", verify=str(cert), headers={"Host": "rebind.example"}).status_code == 421
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            httpx.get(base.replace("https:", "http:") + "/health")
        preflight = httpx.options(base + "/v1/chat/completions", verify=str(cert), headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        with httpx.stream("POST", base + "/v1/completions", verify=str(cert),
                          headers={"Authorization": "Bearer env-key", "X-Request-Id": "cli-leaver"},
                          json={"prompt": "go on", "max_tokens": 200, "stream": True} | GREEDY) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        tls.close()  # an open TLS connection would hold up the server's shutdown
        deadline = time.time() + 10
        while "request_id=cli-leaver" not in log_path.read_text() and time.time() < deadline:
            time.sleep(0.1)
    log = log_path.read_text()
    assert "serving tiny at https://" in log
    assert re.search(r"INFO qwenserve\.access: request_id=cli-leaver .* status=499 .* client disconnected", log)
    assert re.search(r"request_id=\w+ method=POST path=/v1/chat/completions status=200 prompt_tokens=\d+ "
                     r"output_tokens=\d+", log)
    assert "Traceback" not in log and "HTTP/1.1\" 200" not in log, log  # no tracebacks; no uvicorn access lines
    assert "tls-zebra" not in log  # no prompt in the log
    assert proc.returncode == 0, log

"""Graceful shutdown: `qwenserve serve` gets SIGTERM under load. New requests get 503 and
/health 503 at once; the requests that can finish within --shutdown-timeout do; the others end with an
OpenAI-shaped error; the process exits 0 soon after, its worker processes gone. Real server subprocesses."""
import asyncio
import inspect
import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.async_engine import AsyncLLMEngine
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.openai.api_server import build_app
from qwenserve.entrypoints.openai.graceful_shutdown import GracefulServer

from helpers import (descendant_pids, live_server, metric_value, pids_gone, save_hf_dir, self_signed_cert,
                     serve_process, tiny_hf_model, wait_idle_and_clean)

SHUTDOWN_TIMEOUT = 4.0
EXIT_SLACK = 8.0  # after the timeout: the abort, uvicorn's connection grace (5 s, which an idle TLS client uses up)
# at >= 2 ms a decode step, a LONG request cannot end within the timeout; a SHORT one, started just before the
# signal, is still running when it comes and ends well within it
SHORT, LONG = 100, 3800
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:  # a 4k context, so LONG fits
    return save_hf_dir(tiny_hf_model(seed=83, max_position_embeddings=4096), str(tmp_path_factory.mktemp("drain")))


def test_shutdown_flag_defaults_to_the_servers_default():
    from qwenserve.config.server_config import SERVER_DEFAULTS
    from qwenserve.entrypoints.cli.main import build_parser
    assert build_parser().parse_args(["serve"]).shutdown_timeout == SERVER_DEFAULTS.shutdown_timeout == 20.0
    assert build_parser().parse_args(["serve", "--shutdown-timeout", "0"]).shutdown_timeout == 0
    assert inspect.signature(GracefulServer).parameters["shutdown_timeout"].default == 20.0


def test_a_second_signal_ends_the_drain_at_once(model_dir):
    """In-process: the first signal drains (a new request is a 503, /health 503, the live stream runs on); a second
    one ends the live stream at once with an error event, frees its KV blocks, and the server stops."""
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=model_dir, dtype="float32",
                                                               kv_cache_memory="16MiB")))
    servers = []

    def graceful(config):
        servers.append(GracefulServer(config, engine, shutdown_timeout=60))
        return servers[-1]
    try:
        with live_server(build_app(engine, ["tiny"]), server_class=graceful) as url:
            body = {"prompt": "hello", "max_tokens": LONG, "stream": True} | GREEDY
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))  # running
                servers[0].handle_exit(signal.SIGTERM, None)
                deadline = time.monotonic() + 2
                while (health := httpx.get(url + "/health")).status_code == 200:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                refused = httpx.post(url + "/v1/completions", json={"prompt": "late"})
                assert engine.num_live_requests == 1  # the stream runs on
                servers[0].handle_exit(signal.SIGTERM, None)
                second = time.monotonic()
                rest = [line[6:] for line in lines if line.startswith("data: ")]
                ended_in = time.monotonic() - second
            assert ended_in < 2 and "[DONE]" not in rest
            assert "shut down before this request finished" in _error_of(503, json.loads(rest[-1]))["message"]
            assert _error_of(health.status_code, health.json())["message"] == "the server is shutting down"
            assert _error_of(refused.status_code, refused.json())["type"] == "server_shutting_down"
            wait_idle_and_clean(engine)
            deadline = time.monotonic() + 5
            while not servers[0].should_exit:  # and the server is on its way out
                assert time.monotonic() < deadline
                time.sleep(0.02)
    finally:
        engine.shutdown()


async def _request(client: httpx.AsyncClient, chat: bool, stream: bool, max_tokens: int) -> dict:
    """One request to its end: status, its JSON (plain) or its events (stream), and when it ended."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hello"}) | GREEDY | {
        "max_tokens": max_tokens, "stream": stream} | ({"stream_options": {"include_usage": True}} if stream else {})
    if not stream:
        r = await client.post(path, json=body)
        return {"status": r.status_code, "json": r.json(), "ended": time.monotonic()}
    async with client.stream("POST", path, json=body) as r:
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    return {"status": r.status_code, "events": events, "ended": time.monotonic()}


async def _running(client: httpx.AsyncClient) -> float:
    return metric_value((await client.get("/metrics")).text, "vllm:num_requests_running")


def _error_of(status: int, body: dict, expected_status: int = 503) -> dict:
    """The error of an OpenAI-shaped error body (exactly that shape, the expected status)."""
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [1, 2])
def test_sigterm_drains_then_exits_0(model_dir, tmp_path, tp):
    """tp=1 serves HTTPS with an idle keep-alive client left open (it must not hold the exit up); tp=2 has worker
    processes, which must be gone afterwards."""
    args = ["--model", model_dir, "--dtype", "float32", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--tensor-parallel-size", str(tp)]
    verify = True
    if tp == 1:
        cert, key = self_signed_cert(tmp_path)
        args += ["--ssl-keyfile", key, "--ssl-certfile", cert]
        verify = cert
    log_path = tmp_path / "serve.log"
    with serve_process(args, log_path, os.environ | {"QWENSERVE_CPU_KERNELS": "0"}, verify=verify) as (proc, base):
        children = descendant_pids(proc.pid)
        if tp > 1:
            assert len(children) >= tp, children

        async def main():
            async with httpx.AsyncClient(base_url=base, verify=verify, timeout=60) as client, \
                    httpx.AsyncClient(base_url=base, verify=verify, timeout=60) as idle:
                assert (await idle.get("/v1/models")).status_code == 200  # then left open and idle until the exit
                kinds = [(chat, stream, n) for n in (SHORT, LONG) for chat in (False, True) for stream in (False, True)]
                tasks = [asyncio.ensure_future(_request(client, *kind)) for kind in kinds]
                deadline = time.monotonic() + 20
                while await _running(client) < len(tasks):
                    assert time.monotonic() < deadline and not any(t.done() for t in tasks)
                    await asyncio.sleep(0.02)
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                while (health := await client.get("/health")).status_code == 200:
                    assert time.monotonic() < signalled + 2
                    await asyncio.sleep(0.02)
                refused = [await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2}),
                           await client.post("/v1/chat/completions",
                                             json={"messages": [{"role": "user", "content": "late"}]})]
                refused_at = time.monotonic()
                results = await asyncio.gather(*tasks)
                try:
                    await asyncio.to_thread(proc.wait, SHUTDOWN_TIMEOUT + EXIT_SLACK - (time.monotonic() - signalled))
                except subprocess.TimeoutExpired:
                    pytest.fail(f"the server did not exit within {SHUTDOWN_TIMEOUT + EXIT_SLACK} s of SIGTERM")
                return kinds, results, health, refused, signalled, refused_at, time.monotonic() - signalled
        kinds, results, health, refused, signalled, refused_at, exited_in = asyncio.run(main())
    log = log_path.read_text()
    assert proc.returncode == 0, log
    assert exited_in < SHUTDOWN_TIMEOUT + EXIT_SLACK
    assert _error_of(health.status_code, health.json())["message"] == "the server is shutting down"
    drain_ended = min(result["ended"] for (_, _, n), result in zip(kinds, results) if n == LONG)
    assert refused_at < drain_ended  # refused at once, while the long requests still ran
    for r in refused:
        assert _error_of(r.status_code, r.json())["type"] == "server_shutting_down" and r.headers["retry-after"]
    for (chat, stream, max_tokens), result in zip(kinds, results):
        what = (chat, stream, max_tokens, result)
        if max_tokens == SHORT:  # running at the signal, then finished normally
            assert result["status"] == 200 and result["ended"] > signalled, what
            if stream:
                assert result["events"][-1] == "[DONE]", what
                usage = json.loads(result["events"][-2])["usage"]
            else:
                usage = result["json"]["usage"]
            assert usage["completion_tokens"] == SHORT, what
        else:  # cut at the deadline with an OpenAI-shaped error: an error event, or a 503
            assert SHUTDOWN_TIMEOUT - 0.5 < result["ended"] - signalled < SHUTDOWN_TIMEOUT + 3, what
            if stream:
                assert result["status"] == 200 and "[DONE]" not in result["events"], what
                error = _error_of(503, json.loads(result["events"][-1]))
            else:
                error = _error_of(result["status"], result["json"])
            assert "shut down before this request finished" in error["message"], what
    assert "SIGTERM: admitting no new requests" in log and "aborted 4 request(s)" in log, log
    assert "Traceback" not in log, log
    assert pids_gone(children, timeout=5), [p for p in children if os.path.exists(f"/proc/{p}")]

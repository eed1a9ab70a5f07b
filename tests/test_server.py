"""The OpenAI-compatible server, live on a loopback port, driven by the official openai client and raw HTTP."""
import asyncio
import json

import httpx
import openai
import pytest

from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.async_engine import AsyncLLMEngine
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.openai.api_server import build_app
from qwenserve.entrypoints.openai.serving_engine import OpenAIServing

from helpers import engine_queue_length, hold_engine_thread, live_server, save_hf_dir, tiny_hf_model, wait_for
from helpers import metric_value as _metric
from helpers import wait_idle_and_clean as idle_and_clean

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_hf_dir(tiny_hf_model(seed=51, max_position_embeddings=256), str(tmp_path_factory.mktemp("srv")))
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32", kv_cache_memory="8MiB")))
    with live_server(build_app(engine, ["tiny", "tiny-alias"], api_key=KEY)) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def test_completion_stream_equals_non_stream(client, server):
    full = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=12, **GREEDY)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model="tiny", prompt="the cat sat", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    idle_and_clean(server[1])


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, **GREEDY)
    assert full.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                                 stream=True, **GREEDY))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == full.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_n_and_seed_are_reproducible(client):
    kwargs = dict(model="tiny", prompt="abc", max_tokens=8, n=3, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1


def test_stop_string(client):
    free = client.completions.create(model="tiny", prompt="hello", max_tokens=30, **GREEDY).choices[0].text
    stop = free[10:12]
    cut = client.completions.create(model="tiny", prompt="hello", max_tokens=30, stop=[stop], **GREEDY).choices[0]
    assert cut.text == free[:free.index(stop)] and cut.finish_reason == "stop"


def test_logprobs(client):
    c = client.completions.create(model="tiny", prompt="xyz", max_tokens=5, logprobs=2, **GREEDY).choices[0]
    assert len(c.logprobs.tokens) == 5 and len(c.logprobs.token_logprobs) == 5
    for token, lp, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert 1 <= len(top) <= 3 and top[token] == lp  # keyed by token text, so equal texts may merge
    echoed = client.completions.create(model="tiny", prompt="hello world", max_tokens=3, logprobs=1, echo=True,
                                       **GREEDY).choices[0]
    n_prompt = len(echoed.logprobs.tokens) - 3
    assert echoed.text.startswith("hello world") and n_prompt > 1
    assert echoed.logprobs.token_logprobs[0] is None and all(
        lp is not None for lp in echoed.logprobs.token_logprobs[1:])
    assert "".join(echoed.logprobs.tokens) == echoed.text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          logprobs=True, top_logprobs=3, **GREEDY).choices[0]
    assert len(chat.logprobs.content) == 4
    for entry in chat.logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the chosen token is the top one


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "a long shared prefix " * 6
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_models_health_tokenize(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    models = httpx.get(server[0] + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert [m["capabilities"] for m in models] == [{"vision": False}] * 2  # a text-only model: no image input
    assert httpx.get(server[0] + "/health").status_code == 200  # open without the key
    headers = {"Authorization": f"Bearer {KEY}"}
    ids = httpx.post(server[0] + "/tokenize", json={"prompt": "hello"}, headers=headers).json()["tokens"]
    assert httpx.post(server[0] + "/detokenize", json={"tokens": ids}, headers=headers).json()["prompt"] == "hello"


@pytest.mark.parametrize("body,status,param,message", [
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "Served models: tiny, tiny-alias"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be >= 0"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": "x", "n": 0}, 400, "n", "n must be"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs", "logprobs must be"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    ({"prompt": ""}, 400, "prompt", "prompt must not be empty"),
    ({"prompt": "x " * 300, "max_tokens": 10}, 400, "prompt", "maximum context length is 256 tokens"),
    ({"max_tokens": 3}, 400, "prompt", "prompt"),
])
def test_completion_errors(server, body, status, param, message):
    r = httpx.post(server[0] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"]


def test_chat_and_transport_errors(server):
    url, headers = server[0], {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers=headers | {"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # the server still works and nothing leaked
    assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers).status_code == 200
    idle_and_clean(server[1])


def test_concurrent_streams(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)
        single = await client.completions.create(model="tiny", prompt="the number", max_tokens=16, **GREEDY)

        async def one():
            text = ""
            async for chunk in await client.completions.create(model="tiny", prompt="the number", max_tokens=16,
                                                                stream=True, **GREEDY):
                text += chunk.choices[0].text if chunk.choices else ""
            return text
        texts = await asyncio.gather(*[one() for _ in range(32)])
        return single.choices[0].text, texts
    single, texts = asyncio.run(main())
    assert texts == [single] * 32
    idle_and_clean(server[1])


@pytest.mark.parametrize("endpoint,body", [
    ("/v1/completions", {"prompt": "go on"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}]}),
])
def test_client_disconnect_aborts_the_request(server, endpoint, body):
    url, headers = server[0], {"Authorization": f"Bearer {KEY}"}
    aborted_before = asyncio.run(server[1].call(lambda e: e.num_aborted))
    body = body | {"max_tokens": 200, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", url + endpoint, json=body, headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                break  # leave after the first chunk
    idle_and_clean(server[1])
    assert asyncio.run(server[1].call(lambda e: e.num_aborted)) == aborted_before + 1
    metrics = httpx.get(url + "/metrics", headers=headers).text  # and visible to monitoring
    assert _metric(metrics, "vllm:request_success_total", finished_reason="abort") == aborted_before + 1


def test_metrics_count_requests(client, server):
    headers = {"Authorization": f"Bearer {KEY}"}  # /metrics needs the key unless --metrics-public
    before = httpx.get(server[0] + "/metrics", headers=headers).text
    client.completions.create(model="tiny", prompt="count me", max_tokens=5, **GREEDY)
    after = httpx.get(server[0] + "/metrics", headers=headers).text
    assert _metric(after, "vllm:generation_tokens_total") - _metric(before, "vllm:generation_tokens_total") == 5
    assert _metric(after, "vllm:time_to_first_token_seconds_count") > _metric(
        before, "vllm:time_to_first_token_seconds_count")
    assert _metric(after, "vllm:num_requests_running", model_name="tiny", engine="0") == 0
    assert _metric(after, "vllm:kv_cache_usage_perc") == 0  # nothing live: every block free or cached
    # memory: the weights, the KV cache reserved (8 MiB), and the blocks ever used, a whole number of them
    engine = server[1].engine
    assert _metric(after, "qwenserve:model_weights_bytes") == engine.weights_bytes > 0
    assert _metric(after, "qwenserve:kv_cache_reserved_bytes") == engine.kv.reserved_bytes
    assert engine.kv.reserved_bytes > 8 * (1 << 20) - engine.kv.bytes_per_block
    touched = _metric(after, "qwenserve:kv_cache_touched_bytes")
    assert touched == engine.kv.num_touched * engine.kv.bytes_per_block and 0 < touched < engine.kv.reserved_bytes
    for name in ("vllm:num_requests_waiting", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:num_preemptions_total",
                 "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        _metric(after, name)


def test_overload_gets_503_with_retry_after(tmp_path):
    """A bounded waiting queue: while the engine thread is busy, three requests arrive for two waiting slots."""
    path = save_hf_dir(tiny_hf_model(seed=52), str(tmp_path / "m"))
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32", kv_cache_memory="4MiB")),
                            max_waiting_requests=2)
    app = build_app(engine, ["tiny"])

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as c:
            with hold_engine_thread(engine):  # the engine is mid-step until all three requests are queued for it
                body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
                posts = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(3)]
                await asyncio.to_thread(wait_for, lambda: engine_queue_length(engine) == 3, what="3 queued requests")
            return await asyncio.gather(*posts)
    try:
        responses = asyncio.run(main())
    finally:
        engine.shutdown()
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 503]
    refused = next(r for r in responses if r.status_code == 503)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["type"] == "server_overloaded"


def test_bench_serve_against_the_live_server(server):
    from qwenserve.benchmarks.serve import run_bench_serve
    result = asyncio.run(run_bench_serve(server[0], num_prompts=8, input_len=12, output_len=6, max_concurrency=4,
                                         request_rate=None, api_key=KEY, model=None, max_token_id=300))
    assert result["model"] == "tiny" and result["completed"] == 8 and result["failed"] == 0
    assert result["output_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(result[key]) == {"mean", "p50", "p90", "p99"} and result[key]["p50"] > 0
    bad = asyncio.run(run_bench_serve(server[0], 2, 4, 4, 2, None, "wrong-key", "tiny", max_token_id=300))
    assert bad["failed"] == 2 and "401" in bad["errors"][0]
    idle_and_clean(server[1])


def test_non_streaming_client_that_gives_up_is_aborted(server, monkeypatch):
    monkeypatch.setattr(OpenAIServing, "DISCONNECT_POLL_S", 0.02)
    engine = server[1]
    aborted_before = asyncio.run(engine.call(lambda e: e.num_aborted))
    body = {"prompt": "go on", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    # the engine thread is held until the client has given up, so the request runs only after that
    with hold_engine_thread(engine):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server[0] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=0.3)
    idle_and_clean(engine)
    assert asyncio.run(engine.call(lambda e: e.num_aborted)) == aborted_before + 1


def test_generation_config_defaults_apply_when_a_request_is_silent(tmp_path, caplog):
    """generation_config.json's top_k=1 makes unspecified sampling greedy; an explicit top_k overrides it."""
    import logging
    path = save_hf_dir(tiny_hf_model(seed=53), str(tmp_path / "m"))
    gen_path = tmp_path / "m" / "generation_config.json"
    gen_path.write_text(json.dumps(json.loads(gen_path.read_text()) | {"top_k": 1, "temperature": 0.9}))
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32", kv_cache_memory="4MiB")))
    with caplog.at_level(logging.INFO, logger="qwenserve.entrypoints.openai.api_server"):
        app = build_app(engine, ["tiny"])
    assert "'top_k': 1" in caplog.text and "'temperature': 0.9" in caplog.text

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            base = {"prompt": "abc", "max_tokens": 12, "ignore_eos": True}
            silent = [(await c.post("/v1/completions", json=base | {"seed": s})).json()["choices"][0]["text"]
                      for s in (1, 2)]
            greedy = (await c.post("/v1/completions", json=base | {"temperature": 0})).json()["choices"][0]["text"]
            free = [(await c.post("/v1/completions", json=base | {"seed": s, "top_k": 0, "temperature": 1.5})
                     ).json()["choices"][0]["text"] for s in (1, 2)]
            return silent, greedy, free
    try:
        silent, greedy, free = asyncio.run(main())
    finally:
        engine.shutdown()
    assert silent == [greedy, greedy]
    assert free[0] != free[1]

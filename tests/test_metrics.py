"""/metrics under vLLM's V1 names on a live server (the tiny random model): the values after a few requests, queue
time while a request waits, preemptions under a small KV cache, and every metric the shipped Grafana dashboard
reads."""
import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.async_engine import AsyncLLMEngine
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.openai.api_server import build_app

from helpers import live_server, metric_names, metric_value, save_hf_dir, tiny_hf_model, wait_idle_and_clean

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "qwenserve-dashboard.json"
BODY = {"model": "tiny", "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    hf = tiny_hf_model(seed=61, num_key_value_heads=2, max_position_embeddings=512)
    return save_hf_dir(hf, str(tmp_path_factory.mktemp("metrics")))


@pytest.fixture
def serve(model_path):
    """serve(**engine_kwargs): a live server on the tiny model (metrics open); the engine shuts down after."""
    engines = []

    def start(**engine_kwargs):
        engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=model_path, dtype="float32",
                                                                   **({"kv_cache_memory": "8MiB"} | engine_kwargs))))
        engines.append(engine)
        return live_server(build_app(engine, ["tiny"], metrics_public=True)), engine
    yield start
    for engine in engines:
        engine.shutdown()


async def _completions(url: str, bodies: list[dict]) -> list[dict]:
    """The bodies posted to /v1/completions at once; their responses."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json=BODY | b) for b in bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


def test_counts_and_histograms_after_three_requests(serve):
    server, engine = serve()
    with server as url:
        bodies = [{"prompt": "one", "max_tokens": 3}, {"prompt": "two words", "max_tokens": 5},
                  {"prompt": "a few more words here", "max_tokens": 7, "n": 2}]
        results = [asyncio.run(_completions(url, [b]))[0] for b in bodies]
        wait_idle_and_clean(engine)
        text = httpx.get(url + "/metrics").text
    n_requests, n_choices = len(bodies), sum(b.get("n", 1) for b in bodies)
    labels = {"model_name": "tiny", "engine": "0"}
    assert metric_value(text, "vllm:request_success_total", finished_reason="length", **labels) == n_choices
    assert metric_value(text, "vllm:request_success_total", finished_reason="stop") == 0
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens", "request_params_n"):
        assert metric_value(text, f"vllm:{name}_count", **labels) == n_requests, name
    assert metric_value(text, "vllm:prompt_tokens_total", **labels) == sum(r["usage"]["prompt_tokens"]
                                                                           for r in results)
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    assert generated == sum(b["max_tokens"] * b.get("n", 1) for b in bodies)
    assert metric_value(text, "vllm:generation_tokens_total", **labels) == generated
    assert metric_value(text, "vllm:request_generation_tokens_sum") == generated
    assert metric_value(text, "vllm:request_params_max_tokens_sum") == sum(b["max_tokens"] for b in bodies)
    assert metric_value(text, "vllm:request_params_n_sum") == n_choices
    # one gap a step after each request's first token (greedy decoding takes one token a step); the n=2
    # request's second sample may take its first token a step after the first sample
    gaps = sum(b["max_tokens"] - 1 for b in bodies)
    assert gaps <= metric_value(text, "vllm:inter_token_latency_seconds_count") <= gaps + 1
    assert metric_value(text, "vllm:request_success_total") == n_choices
    assert metric_value(text, "vllm:num_requests_running") == metric_value(text, "vllm:num_requests_waiting") == 0
    assert 0 <= metric_value(text, "vllm:kv_cache_usage_perc") <= 1
    queries = metric_value(text, "vllm:prefix_cache_queries_total")
    assert queries >= metric_value(text, "vllm:prefix_cache_hits_total") >= 0 and queries > 0
    assert metric_value(text, "vllm:num_preemptions_total") == 0
    assert metric_value(text, "vllm:cache_config_info", engine="0") == 1
    # the histograms use vLLM's bucket boundaries
    assert re.search(r'vllm:time_to_first_token_seconds_bucket\{[^}]*le="2560.0"', text)
    assert re.search(r'vllm:e2e_request_latency_seconds_bucket\{[^}]*le="7680.0"', text)
    # the old names are gone; speculation and LoRA series only where configured
    assert "qwenserve_" not in text
    assert "vllm:spec_decode" not in text and "vllm:lora_requests_info" not in text


def test_queue_time_counts_the_wait_for_a_slot(serve):
    server, engine = serve(max_num_seqs=1)
    with server as url:
        asyncio.run(_completions(url, [{"prompt": "first", "max_tokens": 40}, {"prompt": "second", "max_tokens": 40}]))
        wait_idle_and_clean(engine)
        text = httpx.get(url + "/metrics").text
    assert metric_value(text, "vllm:request_queue_time_seconds_count") == 2
    queued, running = (metric_value(text, f"vllm:request_{name}_time_seconds_sum") for name in ("queue", "inference"))
    # one request waits while the other runs whole: about half the running time in all
    assert queued > 0.3 * running > 0


def test_preemptions_counted_when_the_kv_cache_runs_out(serve):
    # 2 kv heads * 16 dims * 2 layers * 2 (K, V) * 4 bytes = 512 bytes per token: 96 KiB = 192 tokens, far less
    # than the five requests need together (about 400)
    server, engine = serve(kv_cache_memory=96 * 1024)
    prompts = [list(range(3 + i, 33 + 6 * i)) for i in range(5)]  # 30 to 54 tokens
    with server as url:
        asyncio.run(_completions(url, [{"prompt": p, "max_tokens": 50} for p in prompts]))
        wait_idle_and_clean(engine)
        text = httpx.get(url + "/metrics").text
    preemptions = asyncio.run(engine.call(lambda e: e.scheduler.num_preemptions))
    assert preemptions > 0, "the test did not exercise preemption"
    assert metric_value(text, "vllm:num_preemptions_total", model_name="tiny", engine="0") == preemptions
    assert metric_value(text, "vllm:request_success_total", finished_reason="length") == len(prompts)


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric families a PromQL expression reads: identifiers that are not functions, aggregation
    keywords, label matchers, grouping labels, range durations or dashboard variables; a histogram's
    _bucket/_sum/_count sample names give its family name."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # dashboard variables
    names = set()
    for match in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        name, call = match.groups()
        if call or name in PROMQL_WORDS:
            continue
        names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return names


def test_promql_metric_names():
    expr = ('histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket'
            '{model_name=~"$model_name", engine!="x"}[$__rate_interval]))) / ignoring(le) '
            'sum(rate(vllm:request_success_total[5m])) + on (engine) vllm:kv_cache_usage_perc')
    assert promql_metric_names(expr) == {"vllm:time_to_first_token_seconds", "vllm:request_success_total",
                                         "vllm:kv_cache_usage_perc"}


def test_dashboard_reads_only_exported_metrics(serve):
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    assert len(panels) >= 11
    used: dict[str, set[str]] = {}
    for panel in panels:
        exprs = [t["expr"] for t in panel.get("targets", [])]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            for name in promql_metric_names(expr):
                used.setdefault(name, set()).add(panel["title"])
    server, engine = serve()
    with server as url:
        asyncio.run(_completions(url, [{"prompt": "hello", "max_tokens": 4}]))
        wait_idle_and_clean(engine)
        exported = metric_names(httpx.get(url + "/metrics").text)
    missing = {name: sorted(titles) for name, titles in used.items() if name not in exported}
    assert not missing, f"the dashboard reads metrics /metrics does not export: {missing}"
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:kv_cache_usage_perc",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:request_success_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_hits_total",
                 "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total"):
        assert name in used, f"no panel reads {name}"


def test_prometheus_config_scrapes_metrics():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((DASHBOARD.parent.parent / "prometheus" / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]

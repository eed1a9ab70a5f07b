"""The storm: 32 concurrent clients against a live server, 10% of them leaving mid-stream and 5% sending
malformed or hostile requests (n=100000, invalid JSON, a huge max_tokens, wrong types, an unknown role, an
oversized body), made by `bench serve --storm`'s own traffic generator. No valid request is lost, every bad one gets
a 4xx OpenAI-shaped error, the clients that left are counted as aborted, and afterwards nothing runs or waits and
no KV block is held. (An injected step failure ending only its step's requests: tests/test_faults.py.)"""
import asyncio

import httpx
import pytest

from qwenserve.benchmarks.serve import BAD_REQUESTS, run_bench_serve, storm_kinds
from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.async_engine import AsyncLLMEngine
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.openai.api_server import build_app

from helpers import live_server, metric_value, wait_idle_and_clean

pytestmark = pytest.mark.slow  # 120 requests from 32 clients: seconds on two cores

NUM_REQUESTS, CLIENTS = 120, 32  # 12 leave mid-stream, 6 are bad (one of each kind), 102 valid
OUTPUT_LEN = 12
MAX_REQUEST_BYTES = 64 * 1024  # small, so the oversized body is cheap


def test_storm_loses_no_valid_request_and_leaves_nothing_behind(parallel_tiny):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=parallel_tiny[1], dtype="float32",
                                                               kv_cache_memory="4MiB")))
    app = build_app(engine, ["tiny"], max_request_bytes=MAX_REQUEST_BYTES)
    kinds = storm_kinds(NUM_REQUESTS)
    try:
        with live_server(app) as url:
            result = asyncio.run(run_bench_serve(url, NUM_REQUESTS, input_len=8, output_len=OUTPUT_LEN,
                                                 max_concurrency=CLIENTS, request_rate=None, api_key=None,
                                                 model=None, max_token_id=300, storm=True,
                                                 max_request_bytes=MAX_REQUEST_BYTES))
            valid, leavers = kinds.count("valid"), kinds.count("disconnect")
            assert (valid, leavers) == (102, 12)
            assert result["valid_requests"] == result["completed"] == valid, result
            assert result["valid_lost"] == result["failed"] == 0, result  # each with exactly OUTPUT_LEN tokens
            assert result["bad_requests"] == result["bad_4xx"] == result["bad_openai_errors"] == len(BAD_REQUESTS)
            assert result["bad_statuses"] == {kind: [413 if kind == "oversized_body" else 400]
                                              for kind in BAD_REQUESTS}, result
            assert result["disconnected"] == leavers and result["ttft_ms"]["p99"] > 0
            wait_idle_and_clean(engine)
            metrics = httpx.get(url + "/metrics").text
            assert metric_value(metrics, "vllm:request_success_total", finished_reason="abort") == leavers
            assert metric_value(metrics, "vllm:num_requests_running") == 0
            assert metric_value(metrics, "vllm:num_requests_waiting") == 0
            # the leavers never finished
            assert metric_value(metrics, "vllm:request_success_total") - leavers == valid
    finally:
        engine.shutdown()

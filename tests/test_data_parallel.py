"""Data-parallel replicas behind one engine and one server: the same tokens as one replica, requests spread by
load and sent where their prefix is cached, each replica in /metrics, and a replica whose worker dies leaves
the pool while the others serve on."""
import asyncio
import os
import signal

import httpx
import openai
import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.async_engine import AsyncLLMEngine
from qwenserve.engine.data_parallel import DataParallelEngine, build_engine
from qwenserve.entrypoints.openai.api_server import build_app

from helpers import PROMPTS, greedy_tokens, live_server, metric_value, pids_gone


@pytest.fixture(scope="module")
def dp_llm(parallel_tiny):
    llm = LLM(parallel_tiny[1], dtype="float32", data_parallel_size=2)
    yield llm
    llm.engine.shutdown()


@pytest.mark.multiproc
def test_two_replicas_give_one_replicas_tokens(dp_llm, single_process_tokens):
    engine = dp_llm.engine
    assert isinstance(engine, DataParallelEngine) and len(engine.replicas) == 2
    before = list(engine.num_routed)
    assert greedy_tokens(dp_llm) == single_process_tokens
    routed = [after - b for after, b in zip(engine.num_routed, before)]
    assert routed == [3, 3]  # six unrelated prompts, spread by load
    # each replica's worker runs on its own share of the CPUs
    cpus = [os.sched_getaffinity(r.executor._procs[0].pid) for r in engine.replicas]
    assert not cpus[0] & cpus[1] or len(os.sched_getaffinity(0)) < 2


@pytest.mark.multiproc
def test_a_request_goes_where_its_prefix_is_cached(dp_llm):
    engine = dp_llm.engine
    shared = list(range(40, 40 + 64))  # four whole blocks of 16
    first = dp_llm.generate({"prompt_token_ids": shared + [7]}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    owner = [r.kv.hits for r in engine.replicas]
    # unrelated traffic in between, then requests that extend the same prefix
    dp_llm.generate([{"prompt_token_ids": [200 + i] * 20} for i in range(4)], SamplingParams(max_tokens=2),
                    use_tqdm=False)
    later = dp_llm.generate([{"prompt_token_ids": shared + [8 + i]} for i in range(3)],
                            SamplingParams(max_tokens=2), use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert all(out.num_cached_tokens == 64 for out in later)  # every one found the prefix: same replica
    gained = [r.kv.hits - h for r, h in zip(engine.replicas, owner)]
    assert sorted(gained) == [0, 3 * 64]


def test_build_engine_is_one_engine_without_data_parallel(parallel_tiny):
    engine = build_engine(EngineConfig.from_kwargs(model=parallel_tiny[1], dtype="float32"))
    assert not isinstance(engine, DataParallelEngine)


def _completion(client, prompt, max_tokens=12):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})


async def _streams(base_url, prompts, max_tokens=12):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)

    async def one(prompt):
        text, chunks = "", 0
        async for chunk in await _completion(client, prompt, max_tokens):
            text += chunk.choices[0].text if chunk.choices else ""
            chunks += 1
        return text, chunks

    return await asyncio.gather(*[one(p) for p in prompts], return_exceptions=True)


def _serve(path, **kwargs):
    engine = AsyncLLMEngine(build_engine(EngineConfig.from_kwargs(model=path, dtype="float32", **kwargs)))
    return engine, build_app(engine, ["tiny"], metrics_public=True)


@pytest.mark.multiproc
def test_server_streams_from_two_replicas_as_from_one(parallel_tiny):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    results = {}
    for dp in (1, 2):
        engine, app = _serve(parallel_tiny[1], data_parallel_size=dp)
        try:
            with live_server(app) as url:
                results[dp] = asyncio.run(_streams(url, prompts))
                metrics = httpx.get(f"{url}/metrics").text
        finally:
            engine.shutdown()
        if dp == 2:
            routed = [metric_value(metrics, "qwenserve:replica_requests_routed_total", engine=str(rank))
                      for rank in range(2)]
            assert min(routed) >= 1 and sum(routed) == len(prompts)
            assert metric_value(metrics, "qwenserve:replica_alive", engine="1") == 1
            # vLLM's series, one per engine: the requests each ran, and none running now
            finished = [metric_value(metrics, "vllm:e2e_request_latency_seconds_count", engine=str(rank))
                        for rank in range(2)]
            assert finished == routed
            assert metric_value(metrics, "vllm:num_requests_running") == 0
    assert results[2] == results[1]
    assert sum(chunks for _, chunks in results[2]) > 2 * len(prompts)  # streamed, not one chunk each


@pytest.mark.multiproc
def test_a_dead_replica_leaves_the_pool(parallel_tiny):
    engine, app = _serve(parallel_tiny[1], data_parallel_size=2, max_num_seqs=2)
    dp = engine.engine
    victim = dp.replicas[0].executor._procs[0].pid
    try:
        with live_server(app) as url:
            async def main():
                load = asyncio.ensure_future(_streams(url, [PROMPTS[i % 6] for i in range(8)], max_tokens=220))
                # kill once replica 0 is mid-generation (a fixed sleep let a fast machine finish everything first)
                for _ in range(3000):
                    if any(seq.num_output_tokens >= 4 for seq in list(dp.replicas[0].scheduler.running)):
                        break
                    await asyncio.sleep(0.01)
                os.kill(victim, signal.SIGKILL)
                return await asyncio.wait_for(load, timeout=60)
            results = asyncio.run(main())
            failed = [r for r in results if isinstance(r, Exception)]
            served = [r for r in results if not isinstance(r, Exception)]
            assert failed and served  # replica 0's requests failed, replica 1's finished
            for error in failed:  # a 5xx before the stream began, or an error event inside it
                assert "replica" in str(error) and "worker rank 0" in str(error), error
            health = httpx.get(f"{url}/health")
            after = asyncio.run(_streams(url, PROMPTS[:4]))
            metrics = httpx.get(f"{url}/metrics").text
    finally:
        engine.shutdown()
    assert health.status_code == 200  # the pool still serves
    assert not any(isinstance(r, Exception) for r in after)
    assert metric_value(metrics, "qwenserve:replica_alive", engine="0") == 0
    assert pids_gone([victim], timeout=5)
    assert pids_gone([p.pid for r in dp.replicas for p in r.executor._procs], timeout=15)

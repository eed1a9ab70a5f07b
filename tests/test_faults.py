"""Faults that must stay local: a model step that raises fails only the requests in that step (500, blocks
freed) while the engine serves the others; failures in a row turn /health to 503. And KV cache memory sized to
the machine: "auto" by default, an explicit size that cannot fit refused at start with the numbers."""
import asyncio

import httpx
import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import ConfigError
from qwenserve.engine.async_engine import UNHEALTHY_AFTER_FAILED_STEPS, AsyncLLMEngine
from qwenserve.engine.llm_engine import LLMEngine, RequestsFailedError
from qwenserve.entrypoints.openai.api_server import build_app
from qwenserve.worker.memory import AUTO_FRACTION, available_memory

from helpers import PROMPTS, assert_hf_greedy, live_server, step_until_idle, wait_idle_and_clean

POISON = 77  # a prompt token that makes the injected fault fire


def _poison_steps(engine: LLMEngine) -> None:
    """Make the worker raise on any step that computes a prompt containing POISON (as a kernel bug would)."""
    worker = engine.executor.worker
    original = worker.execute_model

    def execute_model(scheduler_output):
        if any(POISON in new.token_ids for new in scheduler_output.new_seqs):
            raise RuntimeError("injected fault")
        return original(scheduler_output)

    worker.execute_model = execute_model


def test_a_failed_step_ends_only_its_requests(parallel_tiny):
    llm = LLM(parallel_tiny[1], dtype="float32", kv_cache_memory="4MiB", max_num_seqs=2)
    engine = llm.engine
    _poison_steps(engine)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"ok-{i}", prompt, params)
    engine.add_request("bad", [POISON] + PROMPTS[2], params)  # waits: two sequences at most run at once
    finished, failures = step_until_idle(engine)
    assert set(failures) == {"bad"} and "injected fault" in str(failures["bad"])
    assert set(finished) == {"ok-0", "ok-1"} and all(len(o.outputs[0].token_ids) == 6 for o in finished.values())
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # the failed request's blocks came back
    assert not engine.scheduler.in_flight
    # and the engine still serves, the same tokens as before
    again = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == finished["ok-0"].outputs[0].token_ids


def test_a_failed_step_leaves_no_prefix_cache_entries(parallel_tiny):
    """Blocks are registered in the prefix cache when a step is scheduled; a step that fails never wrote them, so
    the same prompt again computes its KV instead of reading the unwritten blocks."""
    llm = LLM(parallel_tiny[1], dtype="float32", kv_cache_memory="4MiB", block_size=8)
    engine = llm.engine
    prompt = [POISON] + list(range(3, 40))  # four full blocks
    worker = engine.executor.worker
    original = worker.execute_model
    faults = []

    def fail_once(scheduler_output):
        if not faults and any(POISON in new.token_ids for new in scheduler_output.new_seqs):
            faults.append(1)
            raise RuntimeError("injected fault")
        return original(scheduler_output)
    worker.execute_model = fail_once
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("bad", {"prompt_token_ids": prompt}, params)
    with pytest.raises(RequestsFailedError):
        while engine.has_unfinished_requests():
            engine.step()
    assert faults and not engine.kv.cached
    engine.kv.check_invariants([])
    again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert_hf_greedy(parallel_tiny[0], [prompt], [again.outputs[0].token_ids])
    # now written, the blocks serve the prompt from the cache
    assert llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].num_cached_tokens == 32


def test_server_fails_the_step_with_500_and_serves_the_rest(parallel_tiny):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=parallel_tiny[1], dtype="float32",
                                                               kv_cache_memory="4MiB", max_num_seqs=1)))
    _poison_steps(engine.engine)
    app = build_app(engine, ["tiny"])
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        with live_server(app) as url:
            async def burst(prompts):
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    return await asyncio.gather(*[client.post("/v1/completions", json=body | {"prompt": p})
                                                  for p in prompts])
            answers = asyncio.run(burst([PROMPTS[0], [POISON, 5, 6], PROMPTS[1]]))
            assert [a.status_code for a in answers] == [200, 500, 200]
            error = answers[1].json()["error"]
            assert error["type"] == "server_error" and "StepFailedError" in error["message"]
            assert "Traceback" not in answers[1].text and ".py" not in answers[1].text
            assert httpx.get(f"{url}/health").status_code == 200  # one failure: still healthy
            wait_idle_and_clean(engine)
            # failures in a row: a fault, not a bad batch
            bad = asyncio.run(burst([[POISON, i] for i in range(UNHEALTHY_AFTER_FAILED_STEPS)]))
            assert all(a.status_code == 500 for a in bad)
            assert httpx.get(f"{url}/health").status_code == 503
            assert asyncio.run(burst([PROMPTS[2]]))[0].status_code == 200  # it still serves
            assert httpx.get(f"{url}/health").status_code == 200  # and a good step makes it healthy again
            wait_idle_and_clean(engine)
    finally:
        engine.shutdown()


def test_kv_cache_memory_auto_is_sized_from_available_memory(parallel_tiny):
    llm = LLM(parallel_tiny[1], dtype="float32", max_num_seqs=4)
    engine = llm.engine
    # the tiny model needs little: "auto" gives every sequence slot room for a whole context, and no more
    assert engine.kv.num_blocks == 4 * -(-engine.max_model_len // engine.kv.block_size)
    assert 0 < engine.kv_cache_budget <= AUTO_FRACTION * available_memory(engine.executor.worker.device) * 1.1


@pytest.mark.multiproc
def test_a_kv_cache_that_cannot_fit_is_refused_with_numbers(parallel_tiny):
    with pytest.raises(ConfigError, match=r"kv_cache_memory 1024\.00 GiB x 1 worker\(s\) does not fit: "
                                          r"[\d.]+ GiB available"):
        LLM(parallel_tiny[1], dtype="float32", kv_cache_memory="1TiB")
    with pytest.raises(ConfigError, match=r"x 2 worker\(s\) does not fit"):  # raised in the workers
        LLM(parallel_tiny[1], dtype="float32", kv_cache_memory="1TiB", tensor_parallel_size=2)


"""`qwenserve bench prefix`: time to first token with a shared prefix cached vs not."""
from __future__ import annotations

from qwenserve.benchmarks.common import engine_run, ordinary_vocab, random_prompts
from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.llm_engine import LLMEngine


def bench_prefix(config: EngineConfig, prefix_len: int, num_prompts: int, suffix_len: int = 16) -> dict:
    """TTFT of a request whose prefix is not cached vs one whose prefix was just computed by another."""
    engine = LLMEngine(config)
    vocab = ordinary_vocab(engine.tokenizer)
    engine_run(engine, random_prompts(1, 64, vocab, seed=5), [2])
    cold, warm, warm_hits = [], [], 0
    for i in range(num_prompts):
        prefix = random_prompts(1, prefix_len, vocab, seed=100 + i)[0]
        first, second = random_prompts(2, suffix_len, vocab, seed=200 + i)
        cold.append(engine_run(engine, [prefix + first], [1])["elapsed_s"])
        hits_before = engine.kv.hits
        warm.append(engine_run(engine, [prefix + second], [1])["elapsed_s"])
        warm_hits += engine.kv.hits - hits_before
    cold_ms, warm_ms = sorted(cold)[len(cold) // 2] * 1e3, sorted(warm)[len(warm) // 2] * 1e3
    return {"prefix_len": prefix_len, "num_prompts": num_prompts, "ttft_cold_ms": round(cold_ms, 1),
            "ttft_warm_ms": round(warm_ms, 1), "speedup": round(cold_ms / warm_ms, 2),
            "warm_cached_tokens": warm_hits // num_prompts,
            "prefix_caching": config.cache.enable_prefix_caching}

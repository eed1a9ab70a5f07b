"""`qwenserve bench latency`: one request's time to first token, time per output token and end to end."""
from __future__ import annotations

import time

from qwenserve.benchmarks.common import engine_run, hf_generate, hf_model_like, ordinary_vocab, random_prompts
from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.data_parallel import build_engine


def bench_latency(config: EngineConfig, input_len: int, output_len: int, baseline: str | None) -> dict:
    engine = build_engine(config)
    vocab = ordinary_vocab(engine.tokenizer)
    prompt = random_prompts(1, input_len, vocab, seed=7)
    engine_run(engine, random_prompts(1, input_len, vocab, seed=8), [4])  # warm-up
    run = engine_run(engine, prompt, [output_len])
    ttft, e2e = run["ttft_s"]["bench-0"], run["elapsed_s"]
    result = {"input_len": input_len, "output_len": output_len, "ttft_ms": round(ttft * 1e3, 1),
              "tpot_ms": round((e2e - ttft) / max(output_len - 1, 1) * 1e3, 2), "e2e_ms": round(e2e * 1e3, 1),
              "dtype": str(engine.resolved_model.dtype).removeprefix("torch.")}
    if baseline == "hf":
        model = hf_model_like(engine.resolved_model)
        pad = engine.tokenizer.pad_token_id or 0
        del engine
        hf_generate(model, random_prompts(1, input_len, vocab, seed=8), 4, pad)
        start = time.perf_counter()
        hf_generate(model, prompt, 1, pad)
        hf_ttft = time.perf_counter() - start
        start = time.perf_counter()
        hf_generate(model, prompt, output_len, pad)
        hf_e2e = time.perf_counter() - start
        hf_tpot = (hf_e2e - hf_ttft) / max(output_len - 1, 1)
        result.update(baseline="hf", baseline_ttft_ms=round(hf_ttft * 1e3, 1),
                      baseline_tpot_ms=round(hf_tpot * 1e3, 2), baseline_e2e_ms=round(hf_e2e * 1e3, 1),
                      speedup=round(hf_tpot / (result["tpot_ms"] / 1e3), 2))
    return result

"""`qwenserve bench latency`: one request's time to first token, time per output token and end to end."""
from __future__ import annotations

import time

from qwenserve.benchmarks.common import engine_run, hf_generate, hf_model_like, ordinary_vocab, random_prompts
from qwenserve.benchmarks.decode_bytes import gguf_decode_weight_bytes, kv_bytes_per_context_token
from qwenserve.benchmarks.kernels import read_bandwidth
from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.model_config import resolve_kv_cache_dtype
from qwenserve.engine.data_parallel import build_engine


def bench_latency(config: EngineConfig, input_len: int, output_len: int, baseline: str | None) -> dict:
    # a GGUF file's (the bundled model's without --model) step reads where its blocks are what runs, beside the
    # bandwidth measured before the model loads: the 1 GiB buffer never sits beside the weights
    gguf = (config.load.model or ".gguf").endswith(".gguf") and config.load.quantization in (None, "gguf")
    bandwidth = read_bandwidth() if gguf else None
    engine = build_engine(config)
    vocab = ordinary_vocab(engine.tokenizer)
    prompt = random_prompts(1, input_len, vocab, seed=7)
    engine_run(engine, random_prompts(1, input_len, vocab, seed=8), [4])  # warm-up
    run = engine_run(engine, prompt, [output_len])
    ttft, e2e = run["ttft_s"]["bench-0"], run["elapsed_s"]
    result = {"input_len": input_len, "output_len": output_len, "ttft_ms": round(ttft * 1e3, 1),
              "tpot_ms": round((e2e - ttft) / max(output_len - 1, 1) * 1e3, 2), "e2e_ms": round(e2e * 1e3, 1),
              "dtype": str(engine.resolved_model.dtype).removeprefix("torch.")}
    if bandwidth is not None:
        result.update(decode_reads(engine, config, input_len + output_len // 2, result["tpot_ms"], bandwidth))
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


def decode_reads(engine, config: EngineConfig, mean_context: int, tpot_ms: float, bandwidth: float) -> dict:
    """The bytes a decode step reads (GGUF weights, module decode_bytes, and the KV cache at the mean context)
    and the read rate the time per output token makes of them, beside the machine's measured read bandwidth."""
    resolved = engine.resolved_model
    weights = gguf_decode_weight_bytes(resolved.path)
    kv = kv_bytes_per_context_token(resolved.config, resolved.dtype,
                                    resolve_kv_cache_dtype(config.cache.kv_cache_dtype)) * mean_context
    step_bytes = weights["total"] + kv
    rate = step_bytes / (tpot_ms / 1e3) / 1e9
    parts = {"weights" if k == "total" else k: v for k, v in weights.items()} | {"kv": kv}
    return {"step_read_MB": {k: round(v / 1e6, 3) for k, v in parts.items()},
            "decode_read_GBps": round(rate, 2), "read_bandwidth_GBps": round(bandwidth, 2),
            "bandwidth_share_pct": round(100 * rate / bandwidth, 1)}

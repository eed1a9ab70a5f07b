"""`qwenserve bench long-context`: one long prompt's prefill time, decode time per output token and peak resident
memory at each length, without and with dual-chunk attention (DCA) on the same checkpoint."""
from __future__ import annotations

import dataclasses
import gc
import time

from qwenserve.benchmarks.common import engine_run, ordinary_vocab, random_prompts
from qwenserve.config.dual_chunk_config import merge_overrides
from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.model.layers.attention import PagedKVCache
from qwenserve.worker.memory import model_weights_bytes


def with_overrides(config: EngineConfig, overrides: dict | None) -> EngineConfig:
    """The config with hf_overrides merged over the ones it has (None: as it is)."""
    if overrides is None:
        return config
    merged = merge_overrides(config.load.hf_overrides or {}, overrides)
    return dataclasses.replace(config, load=dataclasses.replace(config.load, hf_overrides=merged))


def reset_peak_rss() -> None:
    """Start this process's peak resident memory (VmHWM) afresh (Linux; elsewhere a no-op)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_gib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return round(kib / 2**20, 2)
    except (OSError, StopIteration):
        return None


def bench_long_context(config: EngineConfig, lengths: list[int], output_len: int, dca: dict,
                       modes: tuple[str, ...] = ("no-dca", "dca")) -> dict:
    """For each mode (no DCA, then DCA with `dca` as its dual_chunk_attention_config) one engine; for each
    length one prompt of random tokens, run to output_len tokens: prefill (TTFT) and TPOT, and the peak RSS over
    that request against the weights and the sequence's KV bytes."""
    rows, raw = [], {}  # raw: unrounded (prefill s, TPOT s) by (mode, length), for the ratios
    for mode in modes:
        overrides = {"dual_chunk_attention_config": dca} if mode == "dca" else None
        engine = LLMEngine(with_overrides(config, overrides))
        vocab = ordinary_vocab(engine.tokenizer)
        spec = engine.executor.worker.model.kv_cache_spec()
        kv_per_token = PagedKVCache.bytes_per_block(spec.num_layers, 1, spec.num_kv_heads, spec.head_dim,
                                                    engine.executor.worker.kv_cache.k[0].dtype)
        weights = model_weights_bytes(engine.executor.worker.model)
        engine_run(engine, random_prompts(1, 64, vocab, seed=3), [2])  # warm-up
        for n in lengths:
            prompt = random_prompts(1, n, vocab, seed=n)
            gc.collect()
            reset_peak_rss()
            start = time.perf_counter()
            run = engine_run(engine, prompt, [output_len])
            elapsed = time.perf_counter() - start
            ttft = run["ttft_s"]["bench-0"]
            raw[mode, n] = (ttft, (elapsed - ttft) / max(output_len - 1, 1))
            rows.append({"mode": mode, "prompt_len": n, "prefill_s": round(ttft, 3),
                         "tpot_ms": round((elapsed - ttft) / max(output_len - 1, 1) * 1e3, 1),
                         "peak_rss_gib": peak_rss_gib(), "kv_mib": round(kv_per_token * (n + output_len) / 2**20, 2),
                         "weights_mib": round(weights / 2**20, 1)})
        del engine
        gc.collect()
    result = {"lengths": lengths, "output_len": output_len, "dca": dca, "runs": rows}
    for n in lengths if len(modes) == 2 else ():
        (plain_prefill, plain_tpot), (prefill, tpot) = raw["no-dca", n], raw["dca", n]
        result[f"prefill_ratio_{n}"] = round(prefill / plain_prefill, 3)
        result[f"tpot_ratio_{n}"] = round(tpot / plain_tpot, 3)
    return result


def format_table(result: dict) -> str:
    lines = [f"bench long-context (output_len {result['output_len']}, DCA {result['dca']})",
             f"  {'mode':<8} {'prompt':>7} {'prefill s':>10} {'TPOT ms':>8} {'peak RSS GiB':>13} {'KV MiB':>8} "
             f"{'weights MiB':>12}"]
    for r in result["runs"]:
        lines.append(f"  {r['mode']:<8} {r['prompt_len']:>7} {r['prefill_s']:>10} {r['tpot_ms']:>8} "
                     f"{r['peak_rss_gib']!s:>13} {r['kv_mib']:>8} {r['weights_mib']:>12}")
    for n in result["lengths"] if f"prefill_ratio_{result['lengths'][0]}" in result else ():
        lines.append(f"  {n}: DCA / no DCA prefill {result[f'prefill_ratio_{n}']}x, TPOT {result[f'tpot_ratio_{n}']}x")
    return "\n".join(lines)

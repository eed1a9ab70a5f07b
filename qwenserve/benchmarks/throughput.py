"""`qwenserve bench throughput`: offline throughput, all requests at once, exact output lengths; `--baseline hf`
runs the same workload through HF transformers in the same process (static batches, left padded)."""
from __future__ import annotations

import time

from qwenserve.benchmarks.common import (
    engine_run,
    hf_generate,
    hf_model_like,
    ordinary_vocab,
    peak_rss_gb,
    random_prompts,
    varied_workload,
)
from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.data_parallel import build_engine


def bench_throughput(config: EngineConfig, num_prompts: int, input_len: int, output_len: int, varied: bool,
                     baseline: str | None, hf_batch_size: int) -> dict:
    engine = build_engine(config)
    vocab = ordinary_vocab(engine.tokenizer)
    if varied:
        prompts, outputs = varied_workload(num_prompts, vocab)
    else:
        prompts, outputs = random_prompts(num_prompts, input_len, vocab), [output_len] * num_prompts
    # warm-up at the workload's own shape, on other tokens: the first batch of a size pays one-off costs (heap
    # growth, page faults, kernel set-up), and with the same tokens the timed run would find its prompts in the
    # prefix cache and skip their prefill (which once made later runs look twice as fast)
    engine_run(engine, random_prompts(len(prompts), [len(p) for p in prompts], vocab, seed=99), [4] * len(prompts))
    run = engine_run(engine, prompts, outputs)
    n_in, n_out = sum(map(len, prompts)), sum(outputs)
    result = {"requests": num_prompts, "prompt_tokens": n_in, "output_tokens": n_out,
              "elapsed_s": round(run["elapsed_s"], 3),
              "output_tokens_per_s": round(n_out / run["elapsed_s"], 2),
              "total_tokens_per_s": round((n_in + n_out) / run["elapsed_s"], 2),
              "dtype": str(engine.resolved_model.dtype).removeprefix("torch."), "peak_rss_gb": peak_rss_gb(),
              "kv_cache_gb": round(engine.kv_cache_budget / 1e9, 2)}
    if baseline == "hf":
        model = hf_model_like(engine.resolved_model)
        pad = engine.tokenizer.pad_token_id or 0
        del engine
        hf_generate(model, random_prompts(2, 16, vocab, seed=99), 4, pad)
        start = time.perf_counter()
        order = sorted(range(num_prompts), key=lambda i: len(prompts[i])) if varied else range(num_prompts)
        order = list(order)
        for b in range(0, num_prompts, hf_batch_size):
            idx = order[b:b + hf_batch_size]
            hf_generate(model, [prompts[i] for i in idx], max(outputs[i] for i in idx), pad)
        elapsed = time.perf_counter() - start
        result.update(baseline="hf", baseline_elapsed_s=round(elapsed, 3),
                      baseline_output_tokens_per_s=round(n_out / elapsed, 2),
                      speedup=round(elapsed / run["elapsed_s"], 2))
    return result

"""`qwenserve bench ...`: measurements, never tests. Each prints a table and, with --json, one JSON object as
its last line. `--baseline hf` runs the same workload through HF transformers in the same process."""
from __future__ import annotations

import json
import random
import resource
import time

import torch

from .engine_config import EngineConfig
from .sampling_params import SamplingParams


# ---- workloads -----------------------------------------------------------------------------------------

def random_prompts(n: int, length: int | list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts (ordinary tokens only, no special ids)."""
    rng = random.Random(seed)
    lengths = length if isinstance(length, list) else [length] * n
    return [[rng.randrange(vocab) for _ in range(k)] for k in lengths]


def varied_workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n requests, prompt lengths 16-512 and max_tokens 8-256, the same every run."""
    rng = random.Random(seed)
    lengths = [rng.randint(16, 512) for _ in range(n)]
    outputs = [rng.randint(8, 256) for _ in range(n)]
    return random_prompts(n, lengths, vocab, seed + 1), outputs


def ordinary_vocab(tokenizer) -> int:
    """Token ids below the first added (special) token."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return min(added) if added else len(tokenizer)


def peak_rss_gb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)


# ---- HF transformers baseline ----------------------------------------------------------------------------

def hf_model_like(loaded) -> torch.nn.Module:
    """HF transformers' Qwen2ForCausalLM with exactly the weights qwenserve runs (dequantized, same dtype).
    Built from our checkpoint reader so a GGUF baseline runs plain dense weights, as HF does for an HF dir."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{k: v for k, v in loaded.config.to_hf_dict().items() if k not in ("architectures",)})
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    state = {name: t.to(loaded.dtype) for name, t in loaded.checkpoint.weights()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # its buffers are not in the state dict
    return model.to(loaded.dtype).eval()


@torch.inference_mode()
def hf_generate(model, batch: list[list[int]], new_tokens: int, pad_id: int) -> None:
    """One static batch, left padded, every row run to exactly new_tokens."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=pad_id)


# ---- qwenserve runs --------------------------------------------------------------------------------------

def _engine_run(engine, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    """All requests submitted at once; returns wall time and per-request first-token times."""
    start = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
    first, done = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start
            done += out.finished
    return {"elapsed_s": time.perf_counter() - start, "ttft_s": first}


def bench_throughput(config: EngineConfig, num_prompts: int, input_len: int, output_len: int, varied: bool,
                     baseline: str | None, hf_batch_size: int) -> dict:
    from .engine import LLMEngine

    engine = LLMEngine(config)
    vocab = ordinary_vocab(engine.tokenizer)
    if varied:
        prompts, outputs = varied_workload(num_prompts, vocab)
    else:
        prompts, outputs = random_prompts(num_prompts, input_len, vocab), [output_len] * num_prompts
    _engine_run(engine, random_prompts(2, 16, vocab, seed=99), [4, 4])  # warm-up
    run = _engine_run(engine, prompts, outputs)
    n_in, n_out = sum(map(len, prompts)), sum(outputs)
    result = {"requests": num_prompts, "prompt_tokens": n_in, "output_tokens": n_out,
              "elapsed_s": round(run["elapsed_s"], 3),
              "output_tokens_per_s": round(n_out / run["elapsed_s"], 2),
              "total_tokens_per_s": round((n_in + n_out) / run["elapsed_s"], 2),
              "dtype": str(engine.loaded.dtype).removeprefix("torch."), "peak_rss_gb": peak_rss_gb(),
              "kv_cache_gb": round(config.kv_cache_memory / 1e9, 2)}
    if baseline == "hf":
        model = hf_model_like(engine.loaded)
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


def bench_latency(config: EngineConfig, input_len: int, output_len: int, baseline: str | None) -> dict:
    from .engine import LLMEngine

    engine = LLMEngine(config)
    vocab = ordinary_vocab(engine.tokenizer)
    prompt = random_prompts(1, input_len, vocab, seed=7)
    _engine_run(engine, random_prompts(1, input_len, vocab, seed=8), [4])  # warm-up
    run = _engine_run(engine, prompt, [output_len])
    ttft, e2e = run["ttft_s"]["bench-0"], run["elapsed_s"]
    result = {"input_len": input_len, "output_len": output_len, "ttft_ms": round(ttft * 1e3, 1),
              "tpot_ms": round((e2e - ttft) / max(output_len - 1, 1) * 1e3, 2), "e2e_ms": round(e2e * 1e3, 1),
              "dtype": str(engine.loaded.dtype).removeprefix("torch.")}
    if baseline == "hf":
        model = hf_model_like(engine.loaded)
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


def bench_prefix(config: EngineConfig, prefix_len: int, num_prompts: int, suffix_len: int = 16) -> dict:
    """TTFT of a request whose prefix is not cached vs one whose prefix was just computed by another."""
    from .engine import LLMEngine

    engine = LLMEngine(config)
    vocab = ordinary_vocab(engine.tokenizer)
    _engine_run(engine, random_prompts(1, 64, vocab, seed=5), [2])
    cold, warm, warm_hits = [], [], 0
    for i in range(num_prompts):
        prefix = random_prompts(1, prefix_len, vocab, seed=100 + i)[0]
        first, second = random_prompts(2, suffix_len, vocab, seed=200 + i)
        cold.append(_engine_run(engine, [prefix + first], [1])["elapsed_s"])
        hits_before = engine.kv.hits
        warm.append(_engine_run(engine, [prefix + second], [1])["elapsed_s"])
        warm_hits += engine.kv.hits - hits_before
    cold_ms, warm_ms = sorted(cold)[len(cold) // 2] * 1e3, sorted(warm)[len(warm) // 2] * 1e3
    return {"prefix_len": prefix_len, "num_prompts": num_prompts, "ttft_cold_ms": round(cold_ms, 1),
            "ttft_warm_ms": round(warm_ms, 1), "speedup": round(cold_ms / warm_ms, 2),
            "warm_cached_tokens": warm_hits // num_prompts,
            "prefix_caching": config.enable_prefix_caching}


def bench_load(model: str | None, dtype: str, baseline: str | None) -> dict:
    """Seconds from nothing to weights and tokenizer ready, for qwenserve and (with baseline='hf') HF
    transformers reading the same file itself, in the same process (qwenserve first, so HF gets the warmer
    page cache)."""
    from .model_loader import LoadedModel

    start = time.perf_counter()
    loaded = LoadedModel(model, dtype)
    result = {"model": loaded.checkpoint.path, "dtype": str(loaded.dtype).removeprefix("torch."),
              "load_s": round(time.perf_counter() - start, 2)}
    if baseline == "hf":
        import os

        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        path = loaded.checkpoint.path
        del loaded
        start = time.perf_counter()
        kwargs = {"dtype": getattr(torch, result["dtype"])}
        if path.endswith(".gguf"):
            path, kwargs["gguf_file"] = os.path.split(path)
        AutoTokenizer.from_pretrained(path, **{k: v for k, v in kwargs.items() if k == "gguf_file"})
        AutoModelForCausalLM.from_pretrained(path, **kwargs)
        result["baseline_load_s"] = round(time.perf_counter() - start, 2)
        result["speedup"] = round(result["baseline_load_s"] / result["load_s"], 2)
    return result


def print_result(title: str, result: dict, as_json: bool) -> None:
    print(title)
    for key, value in result.items():
        print(f"  {key:<30} {value}")
    if as_json:
        print(json.dumps(result))

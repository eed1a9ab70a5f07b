"""`qwenserve bench lora`: what serving LoRA adapters costs. The throughput workload (all requests at once, exact
output lengths) with the requests spread round-robin over N adapters, against the same workload on the base model,
back to back and alternating; and a one-token request's time with an adapter never seen (its files read and
checked, its weights prepared in the worker) against one already loaded.

The adapters are random, written in PEFT's file layout (adapter_config.json and adapter_model.safetensors) for the
model's own shapes: their text is noise, their cost is a real adapter's of that rank and those target modules."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from qwenserve.benchmarks.common import ordinary_vocab, random_prompts
from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.model_config import ModelConfig
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.lora.peft import CONFIG_FILE, TARGET_MODULES, projection_shapes
from qwenserve.lora.request import LoRARequest
from qwenserve.sample.sampling_params import SamplingParams


def write_random_adapter(config: ModelConfig, directory: str, rank: int, seed: int,
                         targets: tuple[str, ...] = tuple(TARGET_MODULES)) -> str:
    """A rank-`rank` LoRA adapter on every decoder layer's `targets`, random A and B, as PEFT saves one."""
    os.makedirs(directory, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            in_features, out_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
                   "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}, f)
    return directory


def _run(engine: LLMEngine, prompts: list[list[int]], output_len: int, adapters: list[LoRARequest | None],
         tag: str) -> float:
    """Seconds for the whole batch; request i runs with adapters[i % len(adapters)]."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params,
                           lora_request=adapters[i % len(adapters)])
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def bench_lora(config: EngineConfig, num_adapters: int, rank: int, num_prompts: int, input_len: int,
               output_len: int, rounds: int) -> dict:
    lora = config.lora
    if not lora.enable_lora:
        raise ValueError("bench lora needs --enable-lora")
    if rank > lora.max_lora_rank:
        raise ValueError(f"--rank {rank} is above --max-lora-rank {lora.max_lora_rank}")
    if num_adapters > min(lora.max_loras, lora.max_cpu_loras):
        raise ValueError(f"--num-adapters {num_adapters} is more than --max-loras {lora.max_loras} or "
                         f"--max-cpu-loras {lora.max_cpu_loras}: the batch could not hold them all at once")
    engine = LLMEngine(config)
    model_config = engine.resolved_model.config
    with tempfile.TemporaryDirectory(prefix="qwenserve-bench-lora-") as tmp:
        adapters = [LoRARequest(f"bench-{i}", i + 1, write_random_adapter(model_config, f"{tmp}/a{i}", rank, i))
                    for i in range(num_adapters + 1)]
        cold_s, warm_s = _first_request_s(engine, adapters[-1])
        adapters = adapters[:-1]
        vocab = ordinary_vocab(engine.tokenizer)
        prompts = random_prompts(num_prompts, input_len, vocab)
        # warm-up of both on other tokens (one-off costs; and the timed prompts must miss the prefix cache)
        _run(engine, random_prompts(num_prompts, input_len, vocab, seed=99), 4, [None], "warm-base")
        _run(engine, random_prompts(num_prompts, input_len, vocab, seed=98), 4, adapters, "warm-lora")
        times = {"base": [], "lora": []}
        for r in range(rounds):
            # each round runs both on fresh prompts (the adapters' cache salt keeps the two runs from sharing
            # blocks), alternating which goes first
            batch = random_prompts(num_prompts, input_len, vocab, seed=1000 + r)
            order = [("base", [None]), ("lora", adapters)]
            for name, which in order if r % 2 == 0 else order[::-1]:
                times[name].append(_run(engine, batch, output_len, which, f"{name}-{r}"))
    n_out = num_prompts * output_len
    base_s, lora_s = statistics.median(times["base"]), statistics.median(times["lora"])
    return {"adapters": num_adapters, "rank": rank, "targets": ",".join(TARGET_MODULES), "requests": num_prompts,
            "input_len": input_len, "output_len": output_len, "rounds": rounds,
            "base_output_tokens_per_s": round(n_out / base_s, 2),
            "lora_output_tokens_per_s": round(n_out / lora_s, 2),
            "lora_over_base": round(base_s / lora_s, 3),
            "base_runs_s": [round(t, 2) for t in times["base"]], "lora_runs_s": [round(t, 2) for t in times["lora"]],
            "first_request_new_adapter_s": round(cold_s, 3), "first_request_loaded_adapter_s": round(warm_s, 3),
            "dtype": str(engine.resolved_model.dtype).removeprefix("torch.")}


def _first_request_s(engine: LLMEngine, adapter: LoRARequest) -> tuple[float, float]:
    """Seconds for a one-token request with a never-seen adapter (the engine checks its files, the worker reads
    and prepares it: an upper bound of loading it), and the best of three once it is loaded."""
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def one(tag: str) -> float:
        start = time.perf_counter()
        engine.add_request(tag, {"prompt_token_ids": [1, 2, 3]}, params, lora_request=adapter)
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start
    return one("load-cold"), min(one(f"load-warm-{i}") for i in range(3))

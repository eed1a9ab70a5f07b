"""`qwenserve bench ...`: measurements, never tests. Each prints a table and, with --json, one JSON
object as its last line."""
from __future__ import annotations

import json
import time


def bench_load(model: str | None, dtype: str, baseline: str | None) -> dict:
    """Seconds from nothing to weights and tokenizer ready, for qwenserve and (with baseline='hf') HF
    transformers on the same file, in the same process (qwenserve first, so HF gets the warmer page cache)."""
    from .model_loader import LoadedModel

    start = time.perf_counter()
    loaded = LoadedModel(model, dtype)
    result = {"model": loaded.checkpoint.path, "dtype": str(loaded.dtype).removeprefix("torch."),
              "load_s": round(time.perf_counter() - start, 2)}
    if baseline == "hf":
        import os

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        path = loaded.checkpoint.path
        del loaded
        start = time.perf_counter()
        if path.endswith(".gguf"):
            directory, name = os.path.split(path)
            AutoTokenizer.from_pretrained(directory, gguf_file=name)
            AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=getattr(torch, result["dtype"]))
        else:
            AutoTokenizer.from_pretrained(path)
            AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, result["dtype"]))
        result["baseline_load_s"] = round(time.perf_counter() - start, 2)
        result["speedup"] = round(result["baseline_load_s"] / result["load_s"], 2)
    return result


def print_result(title: str, result: dict, as_json: bool) -> None:
    print(title)
    for key, value in result.items():
        print(f"  {key:<20} {value}")
    if as_json:
        print(json.dumps(result))

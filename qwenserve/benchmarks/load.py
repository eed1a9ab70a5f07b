"""`qwenserve bench load`: seconds to weights and tokenizer ready, against HF transformers on the same file."""
from __future__ import annotations

import time

import torch


def bench_load(model: str | None, dtype: str, baseline: str | None, cpu_kernels: bool = True) -> dict:
    """Seconds from nothing to weights and tokenizer ready, for qwenserve and (with baseline='hf') HF
    transformers reading the same file itself, in the same process (qwenserve first, so HF gets the warmer
    page cache). cpu_kernels: the setting (off, GGUF blocks are dequantized at load)."""
    from qwenserve.kernels import use_cpu_kernels
    from qwenserve.model.loader.model_loader import LoadedModel

    start = time.perf_counter()
    with use_cpu_kernels(cpu_kernels):
        loaded = LoadedModel(model, dtype)
    result = {"model": loaded.resolved_model.path, "dtype": str(loaded.dtype).removeprefix("torch."),
              "load_s": round(time.perf_counter() - start, 2)}
    if baseline == "hf":
        import os

        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        path = loaded.resolved_model.path
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

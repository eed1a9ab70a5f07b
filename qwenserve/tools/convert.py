"""Write any checkpoint qwenserve reads (HF directory or GGUF) as an HF-format directory:
config.json, generation_config.json, tokenizer files with the chat template, model.safetensors; with a LoRA
adapter, its product merged into the weights it adapts (lora/merge.py)."""
from __future__ import annotations

import json
import logging
import os
import shutil

from safetensors.torch import save_file

from qwenserve.config.model_config import resolve_dtype
from qwenserve.lora.merge import adapter_deltas, merge
from qwenserve.lora.peft import LoRAAdapterError
from qwenserve.model.loader.checkpoint import open_checkpoint

logger = logging.getLogger(__name__)


def convert(model: str | None, output: str, dtype: str = "auto", overwrite: bool = False,
            lora: str | None = None) -> str:
    """lora: a PEFT LoRA adapter directory to merge into the weights (checked first, as the engine checks it)."""
    if os.path.exists(output) and os.listdir(output) and not overwrite:
        raise FileExistsError(f"--output {output} exists and is not empty; choose a new directory or pass --overwrite")
    checkpoint = open_checkpoint(model)
    config = checkpoint.config
    target_dtype = resolve_dtype(dtype, config)
    deltas = adapter_deltas(lora, config) if lora is not None else {}
    tensors = {}
    for name, tensor in checkpoint.weights():
        if name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        tensors[name] = merge(name, tensor, deltas, lora).to(target_dtype).contiguous()
    unmerged = sorted(set(deltas) - set(tensors))
    if unmerged:  # e.g. an AWQ checkpoint holds qweight, not weight: the adapter would be dropped silently
        held = checkpoint.native_quantization
        raise LoRAAdapterError(f"LoRA adapter {lora!r}: the checkpoint has no dense {unmerged[0]} to merge it into"
                               + (f" (its weights are {held}-quantized)" if held != "none" else ""))
    tmp = output.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})

    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = str(target_dtype).removeprefix("torch.")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    generation = dict(checkpoint.generation_config)
    generation.setdefault("bos_token_id", config.bos_token_id)
    generation.setdefault("eos_token_id", config.eos_token_id)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    checkpoint.tokenizer().save_pretrained(tmp)

    if os.path.exists(output):
        shutil.rmtree(output)
    os.replace(tmp, output)
    logger.info("wrote %s: %d tensors in %s%s", output, len(tensors), str(target_dtype).removeprefix("torch."),
                f", LoRA adapter {lora} merged into {len(deltas)} projections" if lora is not None else "")
    return output

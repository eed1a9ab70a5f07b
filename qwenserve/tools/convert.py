"""Write any checkpoint qwenserve reads (HF directory or GGUF) as an HF-format directory:
config.json, generation_config.json, tokenizer files with the chat template, model.safetensors."""
from __future__ import annotations

import json
import logging
import os
import shutil

from safetensors.torch import save_file

from qwenserve.config.model_config import resolve_dtype
from qwenserve.model.loader.checkpoint import open_checkpoint

logger = logging.getLogger(__name__)


def convert(model: str | None, output: str, dtype: str = "auto", overwrite: bool = False) -> str:
    if os.path.exists(output) and os.listdir(output) and not overwrite:
        raise FileExistsError(f"--output {output} exists and is not empty; choose a new directory or pass --overwrite")
    checkpoint = open_checkpoint(model)
    config = checkpoint.config
    target_dtype = resolve_dtype(dtype, config)
    tmp = output.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    tensors = {}
    for name, tensor in checkpoint.weights():
        if name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        tensors[name] = tensor.to(target_dtype).contiguous()
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
    logger.info("wrote %s: %d tensors in %s", output, len(tensors), str(target_dtype).removeprefix("torch."))
    return output

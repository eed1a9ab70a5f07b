"""Write any checkpoint qwenserve reads (HF directory or GGUF) as an HF-format directory:
config.json, generation_config.json, tokenizer files with the chat template, model.safetensors; with a LoRA
adapter, its product merged into the weights it adapts (lora/merge.py).

The weights are written dense, as the source describes them: a GGUF file's dequantized, an FP8 checkpoint's as
its dequantized reference (code x scale, rounded once to --dtype; exact in float32). With quantization "fp8"
they are written instead in Qwen's block-wise FP8 layout (loader/fp8_checkpoint.py), the rest in --dtype."""
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
from qwenserve.model.loader.fp8_checkpoint import (QWEN_FP8_CONFIG, dequantized_weights, fp8_weight_names, is_fp8,
                                                   quantized_weights)

logger = logging.getLogger(__name__)


QUANTIZATIONS = ("none", "fp8")  # what convert writes: dense weights, or Qwen's block-wise FP8


def convert(model: str | None, output: str, dtype: str = "auto", overwrite: bool = False,
            lora: str | None = None, quantization: str = "none") -> str:
    """lora: a PEFT LoRA adapter directory to merge into the weights (checked first, as the engine checks it);
    quantization: "none" (dense weights in dtype) or "fp8" (projections in block-wise FP8, merged adapter
    included; the LM head, embeddings and norms in dtype)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"convert --quantization {quantization!r}: convert writes {' or '.join(QUANTIZATIONS)}")
    if output.endswith(".gguf"):
        raise ValueError(f"--output {output}: convert writes an HF-format directory (config.json, "
                         "model.safetensors), not a GGUF file; name a directory")
    if os.path.exists(output) and os.listdir(output) and not overwrite:
        raise FileExistsError(f"--output {output} exists and is not empty; choose a new directory or pass --overwrite")
    checkpoint = open_checkpoint(model)
    config = checkpoint.config
    source_fp8 = is_fp8(checkpoint.quantization_config)
    if quantization == "fp8" and source_fp8:
        raise ValueError(f"{checkpoint.path} is already an FP8 checkpoint ({checkpoint.native_quantization}); "
                         "quantizing it again would round its values twice. Run it as it is, or convert it "
                         "without --quantization to write its dequantized reference")
    target_dtype = resolve_dtype(dtype, config)
    deltas = adapter_deltas(lora, config) if lora is not None else {}
    weights = checkpoint.weights()
    if source_fp8:  # codes x scales: the dense weights the FP8 checkpoint stands for
        weights = dequantized_weights(weights, checkpoint.quantization_config)
    dense = ((name, merge(name, tensor, deltas, lora)) for name, tensor in weights
             if not (name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")))
    if quantization == "fp8":
        tensors = dict(quantized_weights(dense, fp8_weight_names(config), target_dtype))
    else:
        tensors = {name: tensor.to(target_dtype).contiguous() for name, tensor in dense}
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
    if source_fp8:  # its weights are written dequantized
        hf_config.pop("quantization_config", None)
    if quantization == "fp8":
        hf_config["quantization_config"] = dict(QWEN_FP8_CONFIG)
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
    quantized = sum(name.endswith(".weight_scale_inv") for name in tensors) if quantization == "fp8" else 0
    logger.info("wrote %s: %d tensors in %s%s%s", output, len(tensors), str(target_dtype).removeprefix("torch."),
                f", {quantized} projections in block-wise FP8 (e4m3, 128x128 scales)" if quantized else "",
                f", LoRA adapter {lora} merged into {len(deltas)} projections" if lora is not None else "")
    return output

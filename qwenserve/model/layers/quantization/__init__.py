"""How a model's weights are held (the `quantization` engine argument), as linear methods per kind of layer."""
from __future__ import annotations

from dataclasses import dataclass

from qwenserve.model.layers.linear import LinearMethod
from qwenserve.model.layers.quantization.awq import AWQLinearMethod
from qwenserve.model.layers.quantization.gguf import KERNEL_TYPES, GGUFLinearMethod
from qwenserve.model.layers.quantization.gptq import GPTQLinearMethod
from qwenserve.model.layers.quantization.rtn import Int4LinearMethod, Int8LinearMethod

QUANTIZATIONS = ("none", "gguf", "int8", "int4", "awq", "gptq")


@dataclass(frozen=True)
class QuantizationScheme:
    """The linear method of the decoder layers and of the LM head (None: dense), the GGUF block types the
    loader hands over as blocks rather than dequantized, and whether the embedding keeps its blocks too."""
    layers: LinearMethod | None = None
    lm_head: LinearMethod | None = None
    keep_types: frozenset = frozenset()
    embedding_blocks: bool = False


def quantization_scheme(name: str, quantization_config: dict | None = None) -> QuantizationScheme:
    """The scheme for a resolved quantization name; quantization_config is the checkpoint's (awq, gptq)."""
    if name == "none":
        return QuantizationScheme()
    if name == "gguf":
        method = GGUFLinearMethod()
        return QuantizationScheme(method, method, KERNEL_TYPES, embedding_blocks=True)
    if name == "int8":
        method = Int8LinearMethod()
        return QuantizationScheme(method, method)
    if name == "int4":
        # the head's rounding errors go straight into every logit: it stays in int8, as llama.cpp's Q4 mixes keep
        # their output tensor in 6 or 8 bits
        return QuantizationScheme(Int4LinearMethod(), Int8LinearMethod())
    if name == "awq":  # AWQ and GPTQ checkpoints keep the LM head dense
        return QuantizationScheme(AWQLinearMethod.from_config(quantization_config or {}))
    if name == "gptq":
        return QuantizationScheme(GPTQLinearMethod.from_config(quantization_config or {}))
    raise ValueError(f"unknown quantization {name!r}")

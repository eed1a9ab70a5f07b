"""How a model's weights are held (the `quantization` engine argument), as linear methods per kind of layer.

Each quantization name has one entry in METHODS: how it builds its scheme from the checkpoint's
quantization_config, and which checkpoints it runs on. Resolving a name (loader/resolve.py) reads only these
entries, so a new method is one `register` line here and its own module."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qwenserve.model.layers.linear import LinearMethod
from qwenserve.model.layers.quantization.awq import AWQLinearMethod
from qwenserve.model.layers.quantization.fp8 import FP8Config
from qwenserve.model.layers.quantization.gguf import KERNEL_TYPES, GGUFLinearMethod
from qwenserve.model.layers.quantization.gptq import GPTQLinearMethod
from qwenserve.model.layers.quantization.rtn import Int4LinearMethod, Int8LinearMethod


@dataclass(frozen=True)
class QuantizationScheme:
    """The linear method of the decoder layers and of the LM head (None: dense), the GGUF block types the
    loader hands over as blocks rather than dequantized, and whether the embedding keeps its blocks too."""
    layers: LinearMethod | None = None
    lm_head: LinearMethod | None = None
    keep_types: frozenset = frozenset()
    embedding_blocks: bool = False


@dataclass(frozen=True)
class QuantizationMethod:
    """One quantization name.

    build: the scheme, from the checkpoint's quantization_config ({} for a dense checkpoint or a GGUF file).
    own_checkpoints: None where the method quantizes dense weights at load (or runs none); else what it needs, as
        the sentence that refuses another checkpoint, with {path} and {what} (`not quantized`, `fp8-quantized`).
    exclusive: whether a checkpoint stored this way runs with this quantization only.
    in_config: whether config.json's quantization_config names checkpoints of it (quant_method).
    dequantizes: whether quantization none runs such a checkpoint on its dequantized weights (code x scale, the
        exact reference its quantized path is measured against: loader/fp8_checkpoint.py), as it runs a GGUF
        file's."""
    build: Callable[[dict], QuantizationScheme]
    own_checkpoints: str | None = None
    exclusive: bool = False
    in_config: bool = False
    dequantizes: bool = False


METHODS: dict[str, QuantizationMethod] = {}


def register(name: str, method: QuantizationMethod) -> None:
    if name in METHODS:
        raise ValueError(f"quantization {name!r} is registered twice")
    METHODS[name] = method


def _own(fmt: str) -> str:
    return f"quantization {{name}} loads {fmt} checkpoints, but {{path}} is {{what}}"


def _int4(config: dict) -> QuantizationScheme:
    # the head's rounding errors go straight into every logit: it stays in int8, as llama.cpp's Q4 mixes keep
    # their output tensor in 6 or 8 bits
    return QuantizationScheme(Int4LinearMethod(), Int8LinearMethod())


def _gguf(config: dict) -> QuantizationScheme:
    method = GGUFLinearMethod()
    return QuantizationScheme(method, method, KERNEL_TYPES, embedding_blocks=True)


def _int8(config: dict) -> QuantizationScheme:
    method = Int8LinearMethod()
    return QuantizationScheme(method, method)


def _fp8(config: dict) -> QuantizationScheme:
    return QuantizationScheme(FP8Config.from_fp8_config(config).method())  # the LM head stays dense


def _compressed_tensors(config: dict) -> QuantizationScheme:
    return QuantizationScheme(FP8Config.from_compressed_tensors(config).method())


register("none", QuantizationMethod(lambda config: QuantizationScheme()))
register("gguf", QuantizationMethod(_gguf, "quantization gguf runs a GGUF file's blocks, but {path} is not a GGUF "
                                           "file"))
register("int8", QuantizationMethod(_int8))
register("int4", QuantizationMethod(_int4))
# AWQ and GPTQ checkpoints keep the LM head dense
register("awq", QuantizationMethod(lambda config: QuantizationScheme(AWQLinearMethod.from_config(config)),
                                   _own("AWQ"), exclusive=True, in_config=True))
register("gptq", QuantizationMethod(lambda config: QuantizationScheme(GPTQLinearMethod.from_config(config)),
                                    _own("GPTQ"), exclusive=True, in_config=True))
# fp8 runs FP8 checkpoints (quant_method fp8) and quantizes dense ones at load
register("fp8", QuantizationMethod(_fp8, exclusive=True, in_config=True, dequantizes=True))
register("compressed-tensors", QuantizationMethod(_compressed_tensors, _own("compressed-tensors"), exclusive=True,
                                                  in_config=True, dequantizes=True))


def quantization_scheme(name: str, quantization_config: dict | None = None) -> QuantizationScheme:
    """The scheme for a resolved quantization name; quantization_config is the checkpoint's ({} if it has none)."""
    if name not in METHODS:
        raise ValueError(f"unknown quantization {name!r}")
    return METHODS[name].build(quantization_config or {})

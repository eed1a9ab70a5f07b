"""FP8 checkpoints as tensors: a dense checkpoint's weights quantized into Qwen's published block-wise layout
(Qwen3-*-FP8), and an FP8 checkpoint's weights dequantized into its dense reference (code x scale).

Qwen's layout: config.json's quantization_config is QWEN_FP8_CONFIG; each projection the model runs through its
linear method (q/k/v/o, gate/up/down, a mixture-of-experts layer's experts and shared expert) holds `weight` in
float8_e4m3fn and `weight_scale_inv` in float32, one scale per 128x128 block, each projection quantized alone
(a fused qkv is three checkpoint tensors with three scale grids). The LM head, embeddings, norms, biases and
routers stay in the dense dtype. Which tensors are projections is what the model class says, not a list of
names here: the class is built on the meta device with the block-wise scheme, and a checkpoint name whose
parameter holds e4m3 codes is one.

The dequantized reference is what `--quantization none` runs of an FP8 checkpoint and what `qwenserve convert`
writes of one: every e4m3 weight times its scales (any layout quantization/fp8.py loads: blocks, per tensor,
per channel, compressed-tensors), computed in float32 as the FP8 layer computes it; static input scales have
no place in a dense model and are left out, KV cache scales pass through."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import torch

from qwenserve.config.model_config import ModelConfig
from qwenserve.distributed.pipeline import PipelineParallel
from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.model.layers.quantization import quantization_scheme
from qwenserve.model.layers.quantization.fp8 import E4M3, FP8Config, dequantize, fill_scales, quantize_blocks
from qwenserve.model.registry import MODEL_REGISTRY

logger = logging.getLogger(__name__)

# config.json's quantization_config of Qwen's FP8 releases, key for key
QWEN_FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128]}
FP8_METHODS = ("fp8", "compressed-tensors")  # quant_method of the checkpoints dequantized_weights reads


def is_fp8(quantization_config: dict) -> bool:
    return str(quantization_config.get("quant_method", "")).lower() in FP8_METHODS


def fp8_weight_names(config: ModelConfig) -> Callable[[str], bool]:
    """A test of checkpoint tensor names: True for each `weight` an FP8 checkpoint of this model holds in e4m3."""
    model_class = MODEL_REGISTRY.model_class(MODEL_REGISTRY.resolve(config.architectures))
    with torch.device("meta"):  # shapes and dtypes only: nothing is allocated
        model = model_class(config, config.resolve_max_model_len(None), TensorParallel(),
                            quantization_scheme("fp8", QWEN_FP8_CONFIG), PipelineParallel())
    codes = {name for name, param in model.named_parameters() if param.dtype == E4M3}
    packed = model.packed_modules_mapping

    def quantized(name: str) -> bool:
        target = model.checkpoint_target(name) if name.endswith(".weight") else None
        if target is None:
            return False
        for part, (fused, _) in packed.items():  # q_proj -> qkv_proj, as the loader maps it
            if f".{part}." in target:
                target = target.replace(f".{part}.", f".{fused}.")
                break
        return target in codes
    return quantized


def quantized_weights(weights: Iterable[tuple[str, torch.Tensor]], quantized: Callable[[str], bool],
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen's block-wise FP8 tensors of a dense checkpoint's: each weight `quantized` names as e4m3 codes and its
    `weight_scale_inv` (quantize_blocks, as `--quantization fp8` quantizes at load, so the two load the same),
    every other tensor in dtype."""
    for name, tensor in weights:
        if not quantized(name):
            yield name, tensor.to(dtype).contiguous()
            continue
        if not tensor.is_floating_point() or tensor.dtype.itemsize == 1:
            raise ValueError(f"{name} is {tensor.dtype}; FP8 quantizes bf16, fp16 or fp32 weights")
        codes, scales = quantize_blocks(tensor, tuple(QWEN_FP8_CONFIG["weight_block_size"]))
        yield name, codes
        yield name.removesuffix("weight") + "weight_scale_inv", scales.contiguous()


def _fp8_config(quantization_config: dict) -> FP8Config:
    if str(quantization_config.get("quant_method", "")).lower() == "compressed-tensors":
        return FP8Config.from_compressed_tensors(quantization_config)
    return FP8Config.from_fp8_config(quantization_config)


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]],
                        quantization_config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's tensors with each e4m3 weight replaced by its float32 values, code x scale (the scales
    leave); input scales are dropped, everything else passes as it is. A weight and its scale may come in either
    order (or files apart): the first waits for the second."""
    config = _fp8_config(quantization_config)
    scale_suffix = "." + config.scale_name
    codes: dict[str, torch.Tensor] = {}  # module -> e4m3 weight waiting for its scale
    scales: dict[str, torch.Tensor] = {}  # module -> scale waiting for its weight
    dropped = 0
    for name, tensor in weights:
        if name.endswith(".input_scale"):
            dropped += 1
            continue
        if name.endswith(scale_suffix):
            module = name.removesuffix(scale_suffix)
            if module in codes:
                yield f"{module}.weight", _values(config, module, codes.pop(module), tensor)
            else:
                scales[module] = tensor
        elif name.endswith(".weight") and tensor.dtype == E4M3:
            module = name.removesuffix(".weight")
            if module in scales:
                yield name, _values(config, module, tensor, scales.pop(module))
            else:
                codes[module] = tensor
        else:
            yield name, tensor
    if codes or scales:
        lone = [f"{m}.weight has no {config.scale_name}" for m in codes] + [
            f"{m}{scale_suffix} has no e4m3 weight" for m in scales]
        raise ValueError(f"{config.source} checkpoint: {'; '.join(sorted(lone)[:4])}")
    if dropped:
        logger.info("dequantized reference: %d static input scales left out (its activations are not quantized)",
                    dropped)


def _values(config: FP8Config, module: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [N, K] x the checkpoint's scale tensor, through the loader's own reading of scales (fill_scales) and
    the FP8 layer's own product (dequantize), so the reference is exactly what the FP8 layer multiplies by."""
    if codes.dim() != 2:
        raise ValueError(f"{module}.weight must be 2-D, got {tuple(codes.shape)}")
    n, k = codes.shape
    group = config.block[1] if config.block is not None else k
    per_row = torch.zeros(n, -(-k // group), dtype=torch.float32)
    try:
        fill_scales(config, per_row, scale, 0, n, 0, 0, k, exact=True)
    except ValueError as e:
        raise ValueError(f"{module}.{config.scale_name}: {e}") from e
    return dequantize(codes, per_row, group, torch.float32)

"""Build the model for a checkpoint and fill its parameters, each through its own weight_loader."""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import resolve_dtype
from qwenserve.distributed.pipeline import PipelineParallel
from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.kernels import cpu_ops_for
from qwenserve.model.layers.quantization import QUANTIZATIONS, QuantizationScheme, quantization_scheme
from qwenserve.model.loader.checkpoint import Checkpoint, open_checkpoint
from qwenserve.model.loader.ggml_tensor import GGMLTensor
from qwenserve.model.models.qwen2 import Qwen2ForCausalLM

logger = logging.getLogger(__name__)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    pass


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, max_model_len: int,
               tp: TensorParallel = TensorParallel(), device: str | torch.device = "cpu",
               quantization: QuantizationScheme = QuantizationScheme(),
               pp: PipelineParallel = PipelineParallel()) -> Qwen2ForCausalLM:
    """The model with its weights loaded; GGUF tensors of a type in quantization.keep_types reach their
    parameters as blocks (a linear method that runs them), others dequantized."""
    start = time.perf_counter()
    if quantization.layers is not None and cpu_ops_for(device) is None:
        logger.warning("quantized weights: our kernels do not run on %s; they are dequantized at load (dense "
                       "memory and speed)", device)
    with _default_dtype(dtype), torch.device(device):
        model = Qwen2ForCausalLM(checkpoint.config, max_model_len, tp, quantization, pp)
    attn = model.model.own_layers[0].self_attn
    if tp.size > 1 or pp.size > 1:
        logger.info("tensor-parallel rank %d of %d: %d query heads, %d kv heads; pipeline stage %d of %d: layers "
                    "%d-%d", tp.rank, tp.size, attn.num_heads, attn.num_kv_heads, pp.rank, pp.size,
                    model.model.start_layer, model.model.end_layer - 1)
    load_weights(model, checkpoint.weights(quantization.keep_types), checkpoint.naming)
    model.process_weights_after_loading()
    checkpoint.release_pages()
    logger.info("loaded %s weights in %.1f s", checkpoint.path, time.perf_counter() - start)
    return model.eval()


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], naming: str) -> None:
    """Copy checkpoint tensors (HF names) into the model; raise listing every missing and unexpected tensor."""
    params = dict(model.named_parameters())  # a tied LM head appears once, as the embedding
    packed = getattr(model, "packed_modules_mapping", {})
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        target = model.checkpoint_target(name)  # None: a tied head's copy, or another pipeline stage's
        if name.endswith(_IGNORED_SUFFIXES) or target is None:
            continue
        shard = None
        for ckpt_part, (fused, shard_id) in packed.items():
            if f".{ckpt_part}." in target:
                target, shard = target.replace(f".{ckpt_part}.", f".{fused}."), shard_id
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        if isinstance(tensor, GGMLTensor) and not getattr(param, "takes_ggml_blocks", False):
            tensor = tensor.dequantize()  # e.g. the embedding: looked up by row, kept dense
        with torch.no_grad():
            try:
                if shard is None:
                    param.weight_loader(param, tensor) if hasattr(param, "weight_loader") else _copy(param, tensor, name)
                else:
                    param.weight_loader(param, tensor, shard)
            except ValueError as e:  # name the tensor (the loaders only know the parameter)
                raise WeightLoadError(f"{name}: {e}") from e
        loaded.add((target, shard))

    missing = [ckpt for key, ckpt in _expected(params, packed) if key not in loaded]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_summarize(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_summarize(unexpected)}")
        raise WeightLoadError(f"checkpoint does not match the Qwen2 model ({'; '.join(parts)}); "
                              f"expected {naming}")


def _copy(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise WeightLoadError(f"{name}: checkpoint tensor has shape {tuple(tensor.shape)}, "
                              f"the model expects {tuple(param.shape)}")
    param.data.copy_(tensor)


def _expected(params: dict, packed: dict) -> list[tuple[tuple[str, object], str]]:
    """((parameter, shard), checkpoint name) for every tensor a complete checkpoint provides."""
    out = []
    for pname in params:
        shards = [(ckpt, shard) for ckpt, (fused, shard) in packed.items() if f".{fused}." in pname]
        if shards:
            fused = next(f for f, _ in packed.values() if f".{f}." in pname)
            out += [((pname, shard), pname.replace(f".{fused}.", f".{ckpt}.")) for ckpt, shard in shards]
        else:
            out.append(((pname, None), pname))
    return out


def _summarize(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def resolve_quantization(requested: str | None, checkpoint: Checkpoint) -> str:
    """The quantization method to run: the one asked for, else the checkpoint's own (gguf for a GGUF file, awq or
    gptq from config.json's quantization_config). int8 and int4 quantize dense weights (or a GGUF file's,
    dequantized) at load; awq and gptq run only their own checkpoints."""
    native = checkpoint.native_quantization
    if native not in QUANTIZATIONS:
        raise ConfigError(f"{checkpoint.path} holds {native!r}-quantized weights (quantization_config in "
                          f"config.json), which qwenserve does not load; it loads: awq, gptq")
    choice = native if requested is None else str(requested).lower()
    if choice not in QUANTIZATIONS:
        raise ConfigError(f"quantization {requested!r} is not supported; use one of {', '.join(QUANTIZATIONS)}")
    if choice == "gguf" and native != "gguf":
        raise ConfigError(f"quantization gguf runs a GGUF file's blocks, but {checkpoint.path} is not a GGUF file")
    if choice in ("awq", "gptq") and native != choice:
        raise ConfigError(f"quantization {choice} loads {choice.upper()} checkpoints, but {checkpoint.path} is "
                          + ("not quantized" if native == "none" else f"{native}-quantized"))
    if native in ("awq", "gptq") and choice != native:
        raise ConfigError(f"{checkpoint.path} is a {native.upper()} checkpoint: it runs with quantization "
                          f"{native} only, not {choice}")
    _scheme(choice, checkpoint)  # a bad quantization_config fails here, before any worker starts
    return choice


def _scheme(quantization: str, checkpoint: Checkpoint) -> QuantizationScheme:
    try:
        return quantization_scheme(quantization, checkpoint.quantization_config)
    except ValueError as e:
        raise ConfigError(f"{checkpoint.path}: {e}") from e


@dataclass(frozen=True)
class ModelSpec:
    """What to run, resolved once from the engine settings: the checkpoint, the run dtype, the context length,
    and how the weights are held (the quantization method)."""
    checkpoint: Checkpoint
    dtype: torch.dtype
    max_model_len: int
    quantization: str = "none"

    @classmethod
    def resolve(cls, model: str | None = None, dtype: str | torch.dtype | None = "auto",
                max_model_len: int | None = None, quantization: str | None = None) -> ModelSpec:
        checkpoint = open_checkpoint(model)
        spec = cls(checkpoint, resolve_dtype(dtype, checkpoint.config),
                   checkpoint.config.resolve_max_model_len(max_model_len),
                   resolve_quantization(quantization, checkpoint))
        checkpoint.config.log_shape(spec.dtype, spec.max_model_len)
        logger.info("quantization: %s", spec.quantization)
        return spec

    def stop_token_ids(self, tokenizer) -> set[int]:
        """EOS ids from generation_config, the config and the tokenizer."""
        ids: set[int] = set()
        for value in (self.checkpoint.generation_config.get("eos_token_id"), self.checkpoint.config.eos_token_id,
                      tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    def load_model(self, device: str | torch.device = "cpu", tp: TensorParallel = TensorParallel(),
                   pp: PipelineParallel = PipelineParallel()) -> Qwen2ForCausalLM:
        return load_model(self.checkpoint, self.dtype, self.max_model_len, tp, device,
                          _scheme(self.quantization, self.checkpoint), pp)


class LoadedModel:
    """A checkpoint made ready to run in this process, model and tokenizer (for tools and tests; the engine
    splits the two between its worker and its input/output processing)."""

    def __init__(self, model: str | None = None, dtype: str | torch.dtype | None = "auto",
                 max_model_len: int | None = None, device: str = "cpu", quantization: str | None = "none"):
        start = time.perf_counter()
        self.spec = ModelSpec.resolve(model, dtype, max_model_len, quantization)
        self.checkpoint, self.config = self.spec.checkpoint, self.spec.checkpoint.config
        self.dtype, self.max_model_len = self.spec.dtype, self.spec.max_model_len
        self.tokenizer = self.checkpoint.tokenizer()
        self.model = self.spec.load_model(device)
        self.load_seconds = time.perf_counter() - start

    @property
    def model_id(self) -> str:
        return self.checkpoint.model_id

"""Build the model a ResolvedModel names and fill its parameters, each through its own weight_loader."""
from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterable

import torch
from torch import nn

from qwenserve.config.engine_config import LoadConfig
from qwenserve.config.resolved_model import ResolvedModel
from qwenserve.distributed.pipeline import PipelineParallel
from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.kernels import cpu_ops_for
from qwenserve.model.interface import CausalLM
from qwenserve.model.layers.attention import Attention
from qwenserve.model.layers.quantization import quantization_scheme
from qwenserve.model.loader.checkpoint import reopen_checkpoint
from qwenserve.model.loader.fp8_checkpoint import dequantized_weights, is_fp8
from qwenserve.model.loader.ggml_tensor import GGMLTensor
from qwenserve.model.loader.resolve import load_tokenizer, resolve_model

logger = logging.getLogger(__name__)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# a layer's KV cache scales as FP8 checkpoints name them: self_attn.k_scale / v_scale (vLLM's fp8), self_attn.kv_scale
# (older files: one for both), self_attn.k_proj.output_scale / v_proj.output_scale (compressed-tensors)
_LAYER_NUMBER = re.compile(r"model\.layers\.(\d+)\.")
_KV_SCALE = re.compile(r"(?P<layer>.+\.self_attn)\.(?:attn\.)?(?:(?P<which>k_scale|v_scale|kv_scale)|"
                       r"(?P<proj>k|v)_proj\.output_scale)$")


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


def load_model(resolved: ResolvedModel, device: str | torch.device = "cpu", tp: TensorParallel = TensorParallel(),
               pp: PipelineParallel = PipelineParallel()) -> CausalLM:
    """This process's part of the resolved model (its class from the registry, looked up by the engine) with its
    weights loaded; GGUF tensors of a type the quantization keeps reach their parameters as blocks (a linear
    method that runs them), others dequantized."""
    start = time.perf_counter()
    quantization = quantization_scheme(resolved.quantization, resolved.quantization_config)
    if quantization.layers is not None and cpu_ops_for(device) is None:
        logger.warning("quantized weights: our kernels do not run on %s; they are dequantized at load (dense "
                       "memory and speed)", device)
    checkpoint = reopen_checkpoint(resolved)
    with _default_dtype(resolved.dtype), torch.device(device):
        model = resolved.model_class(resolved.config, resolved.max_model_len, tp, quantization, pp)
        name_layers(model)
    weights = checkpoint.weights(quantization.keep_types)
    if resolved.quantization == "none" and is_fp8(resolved.quantization_config):  # the dequantized reference
        weights = dequantized_weights(weights, resolved.quantization_config)
    try:
        load_weights(model, weights, checkpoint.naming, resolved.config.num_hidden_layers,
                     checkpoint.layer_count_key)
    except WeightLoadError as e:  # the tensor is named; the checkpoint too, for a user who loads several
        raise WeightLoadError(f"{checkpoint.path}: {e}") from e
    model.process_weights_after_loading(after_each=checkpoint.release_pages)
    checkpoint.release_pages()  # again, for a model class that does not call after_each
    logger.info("loaded %s weights in %.1f s", checkpoint.path, time.perf_counter() - start)
    return model.eval()


def name_layers(model: CausalLM) -> None:
    """Tell each linear method that asks (`named`) the checkpoint names of its layer's shards (q_proj, k_proj and
    v_proj of a qkv_proj), and each module of several checkpoint layers that asks (`checkpoint_named`: a layer's
    experts) how its parts are named: a checkpoint's list of layers left unquantized is by those names. A model
    whose checkpoints name a module in more than one way (Qwen2-VL: as published and as transformers 5 does) gives
    them all (`checkpoint_names`), the published one first."""
    packed = model.packed_modules_mapping
    names_of = getattr(model, "checkpoint_names", lambda name: (name,))
    for name, module in list(model.named_modules()):  # a module told its names may rebuild its children
        named = getattr(getattr(module, "linear_method", None), "named", None)
        if named is not None:
            parent, _, leaf = name.rpartition(".")
            shards = {shard: names_of(f"{parent}.{part}") for part, (fused, shard) in packed.items() if fused == leaf}
            named(module, shards or {None: names_of(name)})
        parts_named = getattr(module, "checkpoint_named", None)
        if parts_named is not None:
            parts_named(lambda part, prefix=name: names_of(f"{prefix}.{part}"))


def load_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]], naming: str,
                 num_layers: int | None = None, layer_count_key: str = "num_hidden_layers") -> None:
    """Copy checkpoint tensors (HF names) into the model; raise listing every missing and unexpected tensor.
    num_layers: the model's decoder layers, as the checkpoint's layer_count_key says: a tensor of a layer past
    them is refused at once (the checkpoint holds a deeper model than its config says)."""
    params = dict(model.named_parameters())  # a tied LM head appears once, as the embedding
    modules = dict(model.named_modules())
    packed = model.packed_modules_mapping
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    check_dropped = getattr(model, "check_dropped", None)
    for name, tensor in weights:
        target = model.checkpoint_target(name)  # None: a tied head's copy, or another pipeline stage's
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if target is None:
            if check_dropped is not None:
                try:
                    check_dropped(name, tensor)
                except ValueError as e:
                    raise WeightLoadError(f"{name}: {e}") from e
            continue
        kv_scale = _KV_SCALE.match(target)
        if kv_scale is not None and isinstance(modules.get(kv_scale["layer"] + ".attn"), Attention):
            which = kv_scale["which"] or kv_scale["proj"]
            try:
                modules[kv_scale["layer"] + ".attn"].load_kv_scale(which.removesuffix("_scale"), tensor)
            except ValueError as e:
                raise WeightLoadError(f"{name}: {e}") from e
            continue
        shard = None
        for ckpt_part, (fused, shard_id) in packed.items():
            if f".{ckpt_part}." in target:
                target, shard = target.replace(f".{ckpt_part}.", f".{fused}."), shard_id
                break
        param = params.get(target)
        layer = _LAYER_NUMBER.match(target)
        if param is None and layer and num_layers is not None and int(layer[1]) >= num_layers:
            raise WeightLoadError(f"{name} is a tensor of layer {layer[1]}, but {layer_count_key} is "
                                  f"{num_layers}: the checkpoint holds more layers than its config gives the model")
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
        raise WeightLoadError(f"checkpoint does not match the {type(model).__name__} model ({'; '.join(parts)}); "
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


class LoadedModel:
    """A checkpoint made ready to run in this process, model and tokenizer (for tools and tests; the engine
    splits the two between its worker and its input/output processing)."""

    def __init__(self, model: str | None = None, dtype: str | torch.dtype | None = "auto",
                 max_model_len: int | None = None, device: str = "cpu", quantization: str | None = "none"):
        start = time.perf_counter()
        self.resolved_model = resolve_model(LoadConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                                                           device=device, quantization=quantization))
        self.config, self.dtype = self.resolved_model.config, self.resolved_model.dtype
        self.max_model_len = self.resolved_model.max_model_len
        self.tokenizer = load_tokenizer(self.resolved_model)
        self.model = load_model(self.resolved_model, device)
        self.load_seconds = time.perf_counter() - start

    @property
    def model_id(self) -> str:
        return self.resolved_model.model_id

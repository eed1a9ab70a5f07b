"""`fp8` and `compressed-tensors`: linear weights held as torch.float8_e4m3fn, one byte a weight, with float32
scales, weight[n, k] = code[n, k] * scale. Three checkpoint layouts load, and dense checkpoints quantize at load:

- block-wise (quant_method fp8 with weight_block_size [bn, bk], Qwen's Qwen3-*-FP8): `weight_scale_inv`
  [ceil(N / bn), ceil(K / bk)], one scale per block (partial blocks at the right and bottom edges); the name
  notwithstanding, the codes are multiplied by it;
- per-tensor or per-channel (quant_method fp8 without weight_block_size): `weight_scale` of one value, or of one
  value per output row ([N] or [N, 1]); with activation_scheme static each layer also has `input_scale`;
- compressed-tensors (format float-quantized, weights num_bits 8 type float, strategy tensor, channel or block):
  `weight_scale` [1], [N, 1] or [N / bn, K / bk], and `input_scale` [1] where input_activations are static;
- online (`--quantization fp8` on a bf16 / fp16 / fp32 checkpoint): each checkpoint tensor is quantized as it
  arrives, in 128x128 blocks as a block-wise checkpoint holds it (docs/quantization.md says why), so no more than
  that tensor is ever held in full precision.

Every layout is kept as codes [out, in] and scales [out, groups] (each row's scale per `group` input features: a
block's scale repeated over its rows, a tensor's over all rows), which fused layers (qkv, gate_up) and
tensor-parallel slices cut at any row. Layers the config leaves unquantized (ignored_layers,
modules_to_not_convert, compressed-tensors' ignore) are made dense when the model learns its layers' names
(`named`), a layer's experts too, all of them or none (`experts_left_dense`); the LM head, embeddings and norms are
never quantized here.

apply() keeps the weights one byte each: below WIDEN_IN_REGISTERS_BELOW_ROWS activation rows (decode, batched
decode, speculative verify) our fp8_mm widens the codes in registers inside its dot products (kernels/cpu/dense.cpp);
from there (prefill) bf16 activations on CPUs with AVX512-BF16 and no AMX run on fp8_mm's tiles (codes widened once
per panel of 32 weight rows), and elsewhere slices of about a million weights are widened one at a time
(fp8_dequantize) and multiplied by dense matmuls, in float32 where the CPU has no bf16 arithmetic. Activations stay
in the run dtype (weight-only, W8A16, as vLLM runs FP8 on the CPU), except where the checkpoint has static input
scales: those were calibrated for inputs quantized to e4m3 with them, and the layer quantizes its input so (x / s
saturated at +-448, rounded to e4m3, times s), as vLLM's static FP8 path does."""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.config.tuning import this_cpu_tuning
from qwenserve.kernels import cpu_ops_for
from qwenserve.model.layers.linear import (WIDEN_IN_REGISTERS_BELOW_ROWS, LinearMethod, UnquantizedLinearMethod,
                                           check_checkpoint_shape, variant_has_bf16)

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
ONLINE_BLOCK = (128, 128)
DEQUANTIZE_WEIGHTS = 1 << 20  # weights widened at a time on apply's many-rows route (4 MiB of float32)


@dataclass(frozen=True)
class FP8Config:
    """What a checkpoint's quantization_config says about its FP8 weights.

    strategy: "block", "tensor", "channel", or "tensor_or_channel" (quant_method fp8 without blocks: the scale's
        shape says which); block: (rows, columns) of a scale block; static_input: layers have an input_scale;
    ignore: the names of layers left dense (exact, a dotted prefix or suffix, or "re:" + a regular expression);
    online: dense checkpoint weights, quantized at load."""
    source: str  # how errors name the format: "fp8", "compressed-tensors"
    strategy: str
    block: tuple[int, int] | None = None
    static_input: bool = False
    ignore: tuple[str, ...] = ()
    online: bool = False

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.source == "fp8" and self.strategy == "block" else "weight_scale"

    def method(self) -> FP8LinearMethod:
        return FP8LinearMethod(self)

    @classmethod
    def from_fp8_config(cls, config: dict) -> FP8Config:
        """quant_method fp8 (vLLM's and transformers' FP8 configs); any other config (a dense checkpoint's, {}):
        online quantization."""
        if str(config.get("quant_method", "")).lower() != "fp8":
            return cls("fp8", "block", ONLINE_BLOCK, online=True)
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"quantization_config fmt {fmt!r} is not supported: fp8 loads e4m3 weights "
                             "(float8_e4m3fn)")
        scheme = str(config.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization_config activation_scheme {scheme!r} is not supported (dynamic or static)")
        ignore = tuple(config.get("ignored_layers") or ()) + tuple(config.get("modules_to_not_convert") or ())
        block = config.get("weight_block_size")
        if block is None:
            return cls("fp8", "tensor_or_channel", static_input=scheme == "static", ignore=ignore)
        block = _block_size(block, "weight_block_size")
        if scheme == "static":
            raise ValueError("quantization_config has weight_block_size with activation_scheme static; block-wise "
                             "FP8 checkpoints have dynamic activations")
        return cls("fp8", "block", block, ignore=ignore)

    @classmethod
    def from_compressed_tensors(cls, config: dict) -> FP8Config:
        """compressed-tensors' float-quantized format: FP8 weights (and FP8 or no input quantization) in every
        config group, all groups alike."""
        fmt = config.get("format")
        if fmt != "float-quantized":
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported: qwenserve loads float-quantized "
                             "(FP8) checkpoints")
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        schemes = {cls._group_scheme(name, group) for name, group in groups.items()}
        if len(schemes) > 1:
            raise ValueError(f"compressed-tensors config_groups use different schemes ({sorted(schemes)}); "
                             "qwenserve loads one FP8 scheme per checkpoint")
        strategy, block, static_input = schemes.pop()
        return cls("compressed-tensors", strategy, block, static_input, tuple(config.get("ignore") or ()))

    @staticmethod
    def _group_scheme(name: str, group) -> tuple[str, tuple[int, int] | None, bool]:
        where = f"compressed-tensors config_groups.{name}"
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"{where} has no weights")
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(f"{where}.weights are {weights.get('num_bits')}-bit {weights.get('type')}; qwenserve "
                             "loads 8-bit float (FP8) weights")
        if weights.get("symmetric", True) is not True or weights.get("dynamic", False):
            raise ValueError(f"{where}.weights must be symmetric and static (stored scales)")
        strategy = str(weights.get("strategy"))
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"{where}.weights strategy {strategy!r} is not supported (tensor, channel or block)")
        block = _block_size(weights.get("block_structure"), f"{where}.weights.block_structure") \
            if strategy == "block" else None
        inputs = group.get("input_activations")
        static_input = False
        if inputs is not None:
            if inputs.get("num_bits") != 8 or inputs.get("type") != "float":
                raise ValueError(f"{where}.input_activations are {inputs.get('num_bits')}-bit {inputs.get('type')}; "
                                 "qwenserve loads FP8 or unquantized activations")
            static_input = not inputs.get("dynamic", False)
            if static_input and inputs.get("strategy", "tensor") != "tensor":
                raise ValueError(f"{where}.input_activations: static scales must be per tensor, not "
                                 f"{inputs.get('strategy')!r}")
        return strategy, block, static_input


def _block_size(value, what: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"quantization_config {what} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether an ignore list names the layer (checkpoint name, e.g. model.layers.0.mlp.down_proj)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern):
            return True
    return False


def dequantize(codes: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """codes [rows, K] (e4m3) and scales [rows, ceil(K / group)] -> weights [rows, K] in dtype, each the float32
    product code * scale rounded once to dtype.

    The path where our kernels are not (they widen in registers: fp8_dequantize). torch's own e4m3 -> float32
    conversion runs element by element on the CPU (7.5 ms a million codes on this project's 2-core machine, against
    2.4 ms for most of the bit operations here); instead the code's bits are placed in a float32's (sign to sign;
    exponent and mantissa to the low bits of float32's exponent and the top of its mantissa), which reads as
    code * 2^-120 exactly, subnormal codes included, and the 2^120 rides in the scale: the product is the same
    float32. (The NaN codes 0x7f / 0xff read as 480; no checkpoint holds them.) A scale of 2^8 or more would overflow
    times 2^120 and takes torch's conversion."""
    if bool((scales.abs() >= _UNBIAS_LIMIT).any()):
        weights, factor = codes.float(), scales
    else:
        bits = codes.view(torch.uint8).to(torch.int32)
        weights = (((bits & 0x80) << 24) | ((bits & 0x7F) << 20)).view(torch.float32)
        factor = scales * _UNBIAS
    rows, k = weights.shape
    if factor.shape[1] == 1:
        weights.mul_(factor)
    elif k % group == 0:
        weights.view(rows, k // group, group).mul_(factor.unsqueeze(-1))
    else:
        weights.mul_(factor.repeat_interleave(group, 1)[:, :k])
    return weights.to(dtype)


_UNBIAS = 2.0 ** 120  # float32's exponent bias (127) less e4m3's (7)
_UNBIAS_LIMIT = 2.0 ** 8


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 codes [N, K], float32 scales [ceil(N / bn), ceil(K / bk)]): each block's scale is
    its largest magnitude / 448 (1 for an all-zero block), codes weight / scale rounded to nearest."""
    (n, k), (bn, bk) = weight.shape, block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = weight.float().new_zeros(rows * bn, cols * bk)
    padded[:n, :k] = weight
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    per_weight = scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() / per_weight).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scales


def quantize_online(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense checkpoint tensor (bf16, fp16 or fp32) [N, K] as online FP8 holds it: e4m3 codes as bytes and each
    row's scales [N, ceil(K / bk)], quantized in blocks as a block-wise checkpoint holds them."""
    if not weight.is_floating_point() or weight.dtype.itemsize == 1:
        raise ValueError(f"fp8 quantizes bf16, fp16 or fp32 weights at load; this one is {weight.dtype}")
    codes, scales = quantize_blocks(weight, block)
    return codes.view(torch.uint8), scales.repeat_interleave(block[0], 0)[:weight.shape[0]]


def quantize_online_slice(weight: torch.Tensor, rows: slice, cols: slice,
                          block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_online of weight[rows, cols], one tensor-parallel rank's part: where the part's columns start on a
    block boundary its scale groups are the whole tensor's blocks, so the blocks it touches are quantized whole and the
    part is cut from them (every rank then holds what one process holds); elsewhere the part is quantized alone."""
    bn, bk = block
    if cols.start % bk:
        return quantize_online(weight[rows, cols], block)
    r0 = rows.start - rows.start % bn
    r1, c1 = min(weight.shape[0], -(-rows.stop // bn) * bn), min(weight.shape[1], -(-cols.stop // bk) * bk)
    codes, scales = quantize_online(weight[r0:r1, cols.start:c1], block)
    rows_here = slice(rows.start - r0, rows.stop - r0)
    return codes[rows_here, :cols.stop - cols.start], scales[rows_here, :-(-(cols.stop - cols.start) // bk)]


def quantize_input_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as a static per-tensor FP8 input scale quantizes it: e4m3(x / scale), saturated, times scale."""
    codes = (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return (codes.float() * scale).to(x.dtype)


def expert_config(linear_method) -> FP8Config | None:
    """The FP8 format of a mixture-of-experts layer built with this linear method (its experts then hold e4m3 codes
    and scales: moe.py; online, quantized as they load), or None (dense experts). Until the layer learns its
    experts' names (experts_left_dense), an FP8 checkpoint's experts are taken to be quantized."""
    return linear_method.config if isinstance(linear_method, FP8LinearMethod) else None


def experts_left_dense(config: FP8Config, projections: list[tuple[str, ...]]) -> bool:
    """Whether an FP8 checkpoint's quantization_config leaves a layer's experts unquantized, so that they load
    dense, as an ignored linear layer does. projections: the names a checkpoint may give each expert projection
    (gate_proj, up_proj, down_proj of every expert), the published one first. The config must leave all of them or
    none (one layer's experts are held in one format), and experts held in FP8 must have dynamic inputs."""
    if config.online:
        return False
    skipped = [names[0] for names in projections if any(ignored(name, config.ignore) for name in names)]
    if skipped and len(skipped) < len(projections):
        kept = [names[0] for names in projections if names[0] not in skipped]
        raise ValueError(f"{config.source}: quantization_config leaves {_some(skipped)} unquantized but not "
                         f"{_some(kept)}; qwenserve holds a layer's experts in one format")
    if not skipped and config.static_input:
        raise ValueError(f"{config.source}: experts with static input scales are not supported")
    return bool(skipped)


def _some(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def fill_scales(config: FP8Config, target: torch.Tensor, loaded: torch.Tensor, offset: int, size: int, start: int,
                in_start: int, in_size: int, exact: bool) -> None:
    """Rows [offset, offset + size) of target (scales [rows, groups]) from a checkpoint scale tensor, whose rows
    [start, start + size) and columns [in_start, in_start + in_size) of the weight are this layer's. exact: the
    checkpoint's weight is exactly those rows and columns (one rank), so the scale's shape is checked exactly."""
    name, strategy = config.scale_name, config.strategy
    if not loaded.is_floating_point() or loaded.dtype.itemsize == 1:
        raise ValueError(f"{name} must be float32 (or bf16 / fp16), got {loaded.dtype}")
    loaded = loaded.float()
    if strategy == "block":
        bn, bk = config.block
        if in_start % bk:
            raise ValueError(f"this rank's input columns start at {in_start}, inside a {bk}-column scale block: "
                             f"choose a tensor_parallel_size that splits the inputs at multiples of {bk}")
        want = (-(-size // bn), -(-in_size // bk))
        if exact:
            fits = tuple(loaded.shape) == want
        else:
            fits = (loaded.dim() == 2 and loaded.shape[0] * bn >= start + size
                    and loaded.shape[1] * bk >= in_start + in_size)
        if not fits:
            raise ValueError(f"{name} has shape {tuple(loaded.shape)}; {bn}x{bk} blocks of {size} rows and {in_size} "
                             f"columns need {want}")
        rows = loaded.repeat_interleave(bn, 0)[start:start + size]
        target[offset:offset + size] = rows[:, in_start // bk:in_start // bk + target.shape[1]]
        return
    per_tensor = loaded.numel() == 1
    column = loaded.dim() == 1 or (loaded.dim() == 2 and loaded.shape[1] == 1)
    per_channel = not per_tensor and column and (loaded.shape[0] == size if exact else loaded.shape[0] >= start + size)
    if strategy == "tensor" and not per_tensor:
        raise ValueError(f"{name} has shape {tuple(loaded.shape)}; strategy tensor needs one value, [1]")
    if strategy == "channel" and not (per_channel and loaded.dim() == 2):
        raise ValueError(f"{name} has shape {tuple(loaded.shape)}; strategy channel needs one value per output row, "
                         f"[{size}, 1]")
    if per_tensor:
        target[offset:offset + size] = loaded.reshape(())
    elif per_channel:
        target[offset:offset + size, 0] = loaded.reshape(-1)[start:start + size]
    else:
        raise ValueError(f"{name} has shape {tuple(loaded.shape)}: neither one value (per tensor) nor one per output "
                         f"row ([{size}] or [{size}, 1], per channel)")


def load_codes(config: FP8Config, loaded: torch.Tensor) -> torch.Tensor:
    """loaded, checked to be e4m3 codes, as bytes (copies of fp8 go through uint8, which every
    torch copies on the CPU); raises for another dtype."""
    if loaded.dtype != E4M3:
        hint = "" if loaded.dtype.itemsize == 1 else (
            f" (a layer stored unquantized must be named in the quantization_config's "
            f"{'ignore' if config.source == 'compressed-tensors' else 'ignored_layers'})")
        raise ValueError(f"{config.source} weight is {loaded.dtype}, not float8_e4m3fn{hint}")
    return loaded.view(torch.uint8)


class FP8LinearMethod(LinearMethod):
    def __init__(self, config: FP8Config):
        self.config = config

    # -- creation and names ------------------------------------------------------------------------------------

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        config = self.config
        layer.fp8_group = in_features if config.block is None else config.block[1]
        layer.fp8_input_scales = []  # static input scales, one per (fused) shard
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=E4M3), requires_grad=False)
        groups = -(-in_features // layer.fp8_group)
        if config.online:  # the scales are made here, not loaded: a buffer, not a parameter the checkpoint fills
            layer.weight.weight_loader = functools.partial(self._load_online, layer)
            layer.register_buffer("fp8_scales", torch.zeros(out_features, groups, dtype=torch.float32),
                                  persistent=False)
            return
        layer.weight.weight_loader = functools.partial(self._load_codes, layer)
        scales = nn.Parameter(torch.zeros(out_features, groups, dtype=torch.float32), requires_grad=False)
        scales.weight_loader = functools.partial(self._load_scales, layer)
        setattr(layer, config.scale_name, scales)
        if config.static_input:
            layer.input_scale = nn.Parameter(torch.empty(0), requires_grad=False)
            layer.input_scale.weight_loader = functools.partial(self._load_input_scale, layer)

    def named(self, layer: nn.Module, checkpoint_names: dict) -> None:
        """Told the checkpoint names of each of the layer's shards (shard -> the names a checkpoint may give it):
        a layer the config leaves unquantized becomes a dense one (all its shards, or none: one fused layer holds
        one format)."""
        if self.config.online:
            return
        skipped = [names[0] for names in checkpoint_names.values()
                   if any(ignored(name, self.config.ignore) for name in names)]
        if not skipped:
            return
        if len(skipped) < len(checkpoint_names):
            kept = [names[0] for names in checkpoint_names.values() if names[0] not in skipped]
            raise ValueError(f"{self.config.source}: quantization_config leaves {', '.join(skipped)} unquantized but "
                             f"not {', '.join(kept)}; qwenserve holds them as one fused layer, in one format")
        for name in [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"]:
            delattr(layer, name)
        layer.linear_method = UnquantizedLinearMethod()
        layer.linear_method.create_weights(layer, layer.input_size, layer.output_size)

    # -- loading -----------------------------------------------------------------------------------------------

    def _load_codes(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        codes = load_codes(self.config, loaded)
        if codes.dim() != 2:
            raise ValueError(f"{self.config.source} weight must be 2-D, got {tuple(loaded.shape)}")
        layer.weight_loader(nn.Parameter(param.data.view(torch.uint8), requires_grad=False), codes, shard_id)

    def _load_scales(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset, size, start = layer.output_shard(shard_id)
        fill_scales(self.config, param.data, loaded, offset, size, start, *layer.input_shard(),
                    exact=layer.tp.size == 1)

    def _load_input_scale(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != 1 or not loaded.is_floating_point():
            raise ValueError(f"input_scale must be one floating-point value (a static per-tensor scale), got "
                             f"{loaded.dtype} {tuple(loaded.shape)}")
        value = float(loaded.reshape(()))
        if not value > 0 or value == float("inf"):
            raise ValueError(f"input_scale is {value}; it must be positive and finite")
        layer.fp8_input_scales.append(value)

    def _load_online(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """A dense checkpoint tensor (one part of a fused layer), quantized as it arrives, as a block-wise checkpoint
        would hold it: no more than that tensor is ever in full precision."""
        offset, size, start = layer.output_shard(shard_id)
        in_start, in_size = layer.input_shard()
        check_checkpoint_shape(layer, loaded, shard_id)
        codes, scales = quantize_online_slice(loaded, slice(start, start + size), slice(in_start, in_start + in_size),
                                              self.config.block)
        param.data[offset:offset + size].view(torch.uint8).copy_(codes)
        layer.fp8_scales[offset:offset + size] = scales

    # -- after loading and apply -------------------------------------------------------------------------------

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.online:
            layer.fp8_scales = getattr(layer, self.config.scale_name).data
        # a fused layer's shards may have their own input scales; the largest covers them all (vLLM's choice)
        layer.fp8_input_scale = max(layer.fp8_input_scales) if layer.fp8_input_scales else None
        layer.fp8_ops = fp8_ops(layer.weight.device)
        _log_route(layer.fp8_ops is not None, layer.fp8_ops is not None and layer.fp8_ops.fp8_tiles())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.fp8_input_scale is not None:
            x = quantize_input_static(x, layer.fp8_input_scale)
        return fp8_linear(layer.fp8_ops, layer.weight, layer.fp8_scales, layer.fp8_group, x, bias)


def fp8_linear(ops, codes: torch.Tensor, scales: torch.Tensor, group: int, x: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for W = codes [N, K] (e4m3) times scales [N, ceil(K / group)], W never held widened whole: below
    WIDEN_IN_REGISTERS_BELOW_ROWS rows, and at any count where fp8_mm has tiles for them, through fp8_mm; elsewhere
    through matmuls on slices widened one at a time. ops: fp8_ops() of the weight's device."""
    codes = codes.view(torch.uint8)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = rows.new_empty(rows.shape[0], codes.shape[0])
    if ops is not None and (rows.shape[0] < WIDEN_IN_REGISTERS_BELOW_ROWS or runs_on_tiles(ops, rows, group)):
        ops.fp8_mm(out, rows, codes, scales, group, bias)
    else:
        dtype = matmul_dtype(rows)
        wide_rows = rows.to(dtype)
        step = max(8, DEQUANTIZE_WEIGHTS // codes.shape[1])
        for start in range(0, codes.shape[0], step):
            part = slice(start, start + step)
            out[:, part] = torch.mm(wide_rows, widen(ops, codes[part], scales[part], group, dtype).t())
        if bias is not None:
            out += bias
    return out.reshape(*x.shape[:-1], codes.shape[0])


def runs_on_tiles(ops, rows: torch.Tensor, group: int) -> bool:
    """Whether fp8_mm runs these many activation rows on its own tiles: bf16 activations on AVX512-BF16 builds, whole
    pairs of input columns in every scale group, and as many rows as this CPU's table says (not on AMX CPUs, where
    oneDNN multiplies the widened slices on AMX tiles)."""
    return (rows.dtype == torch.bfloat16 and rows.shape[0] >= this_cpu_tuning().fp8_tiles_from_rows
            and rows.shape[1] % 2 == 0 and group % 2 == 0 and ops.fp8_tiles())


def fp8_ops(device: torch.device):
    """The kernel library whose fp8_mm and fp8_dequantize run FP8 weights on this device; None: the PyTorch path."""
    ops = cpu_ops_for(device)
    return ops if ops is not None and hasattr(ops, "fp8_mm") else None


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype prefill's matmuls on widened FP8 slices run in: the activations', unless that is bf16 / fp16 on a
    CPU without arithmetic in it, where float32 matmuls run several times faster."""
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and not (
            x.dtype == torch.bfloat16 and variant_has_bf16()):
        return torch.float32
    return x.dtype


def widen(ops, codes: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """codes [rows, K] (uint8 e4m3 bits) and their scales as weights [rows, K] in dtype: our kernel where there is
    one, dequantize() elsewhere."""
    if ops is None:
        return dequantize(codes.view(E4M3), scales, group, dtype)
    out = torch.empty(codes.shape, dtype=dtype)
    ops.fp8_dequantize(out, codes, scales, group)
    return out


@functools.cache
def _log_route(kernels: bool, tiles: bool) -> None:
    """Say once per process how FP8 weights run."""
    if kernels:
        logger.info("fp8 weights: one byte a weight, widened in registers inside qwenserve's fp8_mm below %d "
                    "activation rows; from there %s", WIDEN_IN_REGISTERS_BELOW_ROWS,
                    "fp8_mm's tiles for bf16 activations, matmuls on slices widened one at a time for others"
                    if tiles else "matmuls on slices widened one at a time")
    else:
        logger.info("fp8 weights: one byte a weight, dequantized a slice at a time into dense matmuls (no qwenserve "
                    "kernels on this device)")

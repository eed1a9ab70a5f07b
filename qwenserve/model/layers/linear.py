"""Linear layers that shard their weight across tensor-parallel ranks.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's slice of a
full checkpoint tensor into it, so the model loader needs no knowledge of the sharding. The tensor is first checked
to be the whole one the config describes (`checkpoint_shape`), as every rank receives it whole.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.distributed.layout import shard_kv_heads
from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.kernels import chosen_variant, cpu_ops_for

logger = logging.getLogger(__name__)

# Below this many activation rows a 2-byte weight is widened in registers inside our dot products (dense_mm); from
# here its slices are widened to float32 once and multiplied by float32 matmuls (docs/performance.md, "Dense bf16
# and fp16 weights without bf16 arithmetic")
WIDEN_IN_REGISTERS_BELOW_ROWS = 32
# weights widened to float32 at a time on the many-rows route: the slice stays in cache while it is multiplied
WIDEN_SLICE_WEIGHTS = 1 << 20
# Up to this many rows a bf16 weight kept beside oneDNN's packed copy (a tied LM head, which the embedding lookup
# reads) runs through dense_mm's pair dot products instead: oneDNN streams it slower there (docs/performance.md,
# "A tied bf16 LM head at decode")
KEPT_WEIGHT_DENSE_MM_ROWS = 3


class LinearMethod:
    """How a linear layer stores and applies its weight (vLLM's quantization-method seam). The layer owns the
    parameters; the method creates them, may re-arrange them once loading is done, and computes y = x W^T + b.
    Quantized weights and LoRA plug in here without touching the model."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


def cpu_weight_packing_available(weight: torch.Tensor) -> bool:
    """oneDNN can pre-arrange a bf16 weight for its CPU kernels (the layout Inductor uses when freezing): the CPU
    multiplies bf16 in hardware, as the chosen kernel variant sees it."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and variant_has_bf16()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def variant_has_bf16() -> bool:
    """False where the kernel variant this process runs is an x86 build without AVX512-BF16: `--cpu-isa avx2` on a
    CPU that has more then runs bf16 layers as an AVX2 CPU does."""
    variant = chosen_variant()
    return variant is None or variant.arch != "x86_64" or "avx512_bf16" in variant.needs


def variant_has_bf16_pairs() -> bool:
    """The kernel variant this process runs is an x86 build with AVX512-BF16, where dense_mm multiplies bf16
    weights and activations in the pair dot products."""
    variant = chosen_variant()
    return variant is not None and variant.arch == "x86_64" and "avx512_bf16" in variant.needs


def widening_ops(weight: torch.Tensor):
    """The kernel library whose dense_mm runs this 2-byte weight (bf16 or fp16 on a CPU without arithmetic in it);
    None where PyTorch's own matmul runs it."""
    if weight.dtype not in (torch.bfloat16, torch.float16) or cpu_weight_packing_available(weight):
        return None
    ops = cpu_ops_for(weight.device)
    return ops if ops is not None and hasattr(ops, "dense_mm") else None


def widened_linear(ops, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for a bf16 / fp16 weight on a CPU without arithmetic in its dtype, the weight never held widened
    whole: few rows through dense_mm, many through float32 matmuls on slices widened one at a time."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    if rows.shape[0] < WIDEN_IN_REGISTERS_BELOW_ROWS:
        ops.dense_mm(out, rows, weight, bias)
    else:
        wide_rows = rows.float()
        step = max(8, WIDEN_SLICE_WEIGHTS // weight.shape[1])
        for start in range(0, weight.shape[0], step):
            out[:, start:start + step] = torch.mm(wide_rows, weight[start:start + step].float().t())
        if bias is not None:
            out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class UnquantizedLinearMethod(LinearMethod):
    """Dense weights in the run dtype. In bf16 on a CPU with bf16 arithmetic the weight is swapped after loading for
    oneDNN's pre-arranged copy (about 30% faster decode matmuls, same results); the plain weight is then dropped, so
    this costs no memory, unless the layer shares it (a tied LM head keeps it for the embedding lookup). On a CPU
    without it, bf16 and fp16 weights stay as they are and run through widened_linear."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        layer.packed_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.packed_weight is None and cpu_weight_packing_available(layer.weight):
            # A batch-size hint of 32 or more selects oneDNN's AB16b32a2b layout (hint 1: AB16b64a2b). Measured
            # over all of the model's weight shapes, alternating in one process: faster at every M, by 6% at
            # M=1, 16% at M=32, 9% at M=64 and 13% at M=512.
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 32)
            if not getattr(layer, "weight_is_shared", False):
                layer.weight = None
        layer.widening_ops = widening_ops(layer.weight) if layer.weight is not None else None
        layer.kept_weight_ops = (cpu_ops_for(layer.weight.device) if layer.packed_weight is not None
                                 and layer.weight is not None and variant_has_bf16_pairs() else None)
        if layer.packed_weight is not None or layer.widening_ops is not None:
            _log_route(layer.packed_weight is not None, (layer.weight if layer.weight is not None else
                                                         layer.packed_weight).dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed_weight is not None:
            kept = getattr(layer, "kept_weight_ops", None)
            if kept is not None and x.dtype == torch.bfloat16 and x.numel() <= KEPT_WEIGHT_DENSE_MM_ROWS * x.shape[-1]:
                return widened_linear(kept, layer.weight, x, bias)  # few rows: its dense_mm route
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.packed_weight, bias, "none", [], "")
        ops = getattr(layer, "widening_ops", None)
        if ops is not None:
            return widened_linear(ops, layer.weight, x, bias)
        return F.linear(x, layer.weight, bias)


@functools.cache
def _log_route(packed: bool, dtype: torch.dtype) -> None:
    """Say once per process how dense 2-byte weights run, and why."""
    name = str(dtype).removeprefix("torch.")
    if packed:
        logger.info("dense %s weights: oneDNN's %s matmuls (the CPU and the kernel variant have bf16 arithmetic)",
                    name, name)
    else:
        variant = chosen_variant()
        logger.info("dense %s weights: kept in %s and widened to float32 inside qwenserve's dense_mm (kernel variant "
                    "%s: no bf16 arithmetic), float32 matmuls on widened slices from %d rows", name, name,
                    variant.name if variant else "none", WIDEN_IN_REGISTERS_BELOW_ROWS)


def check_checkpoint_shape(layer: nn.Module, loaded, shard_id=None, bias: bool = False) -> None:
    """Raise unless a checkpoint tensor (a GGMLTensor too: its shape in weights) is the whole weight (bias: the
    bias) of the layer's shard, as layer.checkpoint_shape says: checked before a rank narrows it to its part, which
    would otherwise cut a tensor wider than the config says down to fit."""
    rows, columns = layer.checkpoint_shape(shard_id)
    expected = (rows,) if bias else (rows, columns)
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{type(layer).__name__}" + ("" if shard_id is None else f" shard {shard_id}") +
                         f": checkpoint tensor has shape {tuple(loaded.shape)}, the model expects {expected}")


class _ParallelLinear(nn.Module):
    """A linear layer holding this rank's part of the weight: rows [output_shard] of the checkpoint's output
    dimension (column-parallel) and columns [input_shard] of its input dimension (row-parallel)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 linear_method: LinearMethod | None):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = in_features, out_features  # this rank's
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(self, in_features, out_features)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def output_shard(self, shard_id=None) -> tuple[int, int, int]:
        """(offset in this rank's output, rows, first row in the checkpoint tensor) of a (fused) shard."""
        return 0, self.output_size, 0

    def input_shard(self) -> tuple[int, int]:
        """(first column in the checkpoint tensor, columns) of this rank's input."""
        return 0, self.input_size

    def checkpoint_shape(self, shard_id=None) -> tuple[int, int]:
        """(rows, columns) of the whole checkpoint weight of a (fused) shard, of which every rank keeps a part."""
        return self.output_size, self.input_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's part of a checkpoint tensor (weight or bias) into param."""
        offset, size, start = self.output_shard(shard_id)
        check_checkpoint_shape(self, loaded, shard_id, bias=param.dim() == 1)
        target, loaded = param.data.narrow(0, offset, size), loaded.narrow(0, start, size)
        if param.dim() == 2:
            loaded = loaded.narrow(1, *self.input_shard())
        target.copy_(loaded)

    def process_weights_after_loading(self) -> None:
        self.linear_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """lora: the step's adapter batch (AttentionMetadata.lora); a plain layer is never adapted (with LoRA on,
        lora/layers.py wraps every layer an adapter may target), so it takes no part in it."""
        return self.linear_method.apply(self, x, self.bias)


class ColumnParallelLinear(_ParallelLinear):
    """Output features split across ranks; each rank computes its slice, no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TensorParallel = TensorParallel(),
                 linear_method: LinearMethod | None = None):
        if out_features % tp.size:
            raise ValueError(f"output size {out_features} is not divisible by tensor_parallel_size {tp.size}")
        super().__init__(in_features, out_features // tp.size, bias, tp, linear_method)

    def output_shard(self, shard_id=None) -> tuple[int, int, int]:
        return 0, self.output_size, self.tp.rank * self.output_size

    def checkpoint_shape(self, shard_id=None) -> tuple[int, int]:
        return self.output_size * self.tp.size, self.input_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one matrix (gate_proj and up_proj -> gate_up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp: TensorParallel = TensorParallel(), linear_method: LinearMethod | None = None):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp, linear_method)

    def output_shard(self, shard_id: int) -> tuple[int, int, int]:
        size = self.output_sizes[shard_id] // self.tp.size
        return sum(self.output_sizes[:shard_id]) // self.tp.size, size, self.tp.rank * size

    def checkpoint_shape(self, shard_id: int) -> tuple[int, int]:
        return self.output_sizes[shard_id], self.input_size


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, this rank's query heads and kv heads only."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = True,
                 tp: TensorParallel = TensorParallel(), linear_method: LinearMethod | None = None):
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads  # the checkpoint's
        self.num_heads = num_heads // tp.size
        self.num_kv_heads, self.first_kv_head = shard_kv_heads(num_kv_heads, tp)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        _ParallelLinear.__init__(self, hidden_size, out, bias, tp, linear_method)

    def output_shard(self, shard_id: str) -> tuple[int, int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, q, self.tp.rank * q
        if shard_id in ("k", "v"):
            return q if shard_id == "k" else q + kv, kv, self.first_kv_head * self.head_dim
        raise ValueError(f"unknown qkv shard {shard_id!r}")

    def checkpoint_shape(self, shard_id: str) -> tuple[int, int]:
        # k and v hold every kv head, whichever this rank keeps (with fewer kv heads than ranks, a replica of one)
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        return heads * self.head_dim, self.input_size


class RowParallelLinear(_ParallelLinear):
    """Input features split across ranks; partial products are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TensorParallel = TensorParallel(),
                 linear_method: LinearMethod | None = None):
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} is not divisible by tensor_parallel_size {tp.size}")
        super().__init__(in_features // tp.size, out_features, bias, tp, linear_method)

    def input_shard(self) -> tuple[int, int]:
        return self.tp.rank * self.input_size, self.input_size

    def checkpoint_shape(self, shard_id=None) -> tuple[int, int]:
        return self.output_size, self.input_size * self.tp.size

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        # the bias is added once, after the reduction
        y = self.linear_method.apply(self, x, None)
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y

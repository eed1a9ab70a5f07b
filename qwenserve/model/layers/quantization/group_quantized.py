"""`awq` and `gptq`: checkpoints whose linear weights are integer codes in groups along the input features,
weight[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with g = the group of input feature k.

A method here unpacks the checkpoint's int32 words (each format packs them its own way: awq.py, gptq.py) to
codes [out, in], scales and zeros [out, groups] and the group of each input feature, then stores them as ggml
blocks the kernels run: 4-bit codes as Q4_1 (d = scale, m = -zero * scale; Q4_0 when every zero is 8, which is
exact), 8-bit codes with integer zeros as Q8_0 of q - zero. Groups must cover whole 32-weight blocks: GPTQ's
act-order (desc_act) scatters a group over the input features, so the layer's columns are sorted by group once
(`input_order`) and every input row is permuted the same way. A layer that fits no block type (odd group sizes,
fractional 8-bit zeros) is kept dense, with one log line; without the kernels every layer is, from the formula."""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from qwenserve.model.layers.quantization.ggml_blocks import (
    BLOCK,
    GGMLBlockLinearMethod,
    pack_q4_0,
    pack_q4_1,
    pack_q8_0,
)

logger = logging.getLogger(__name__)


def unpack_int32(words: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 words holding 32 / bits codes each, lowest bits first -> codes (int64), `dim` grown by 32 / bits.
    order[i] = which of a word's codes sits in its i-th lowest bits (default: the i-th)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word], arithmetic shift then mask
    if order is not None:
        codes = codes[..., torch.tensor(order).argsort()]
    codes = codes.movedim(-1, dim + 1) if dim == 0 else codes
    shape = list(words.shape)
    shape[dim] *= per_word
    return codes.reshape(shape).long()


class GroupQuantizedLinearMethod(GGMLBlockLinearMethod):
    """The checkpoint parts a format has (qweight, qzeros, scales, ...) arrive one tensor at a time through their
    parameters' loaders; once a (fused) shard has all of them it is unpacked and checked."""
    PARTS: tuple[str, ...] = ("qweight", "qzeros", "scales")
    name = ""

    def __init__(self, bits: int, group_size: int):
        if bits not in (4, 8):
            raise ValueError(f"{self.name}: {bits}-bit weights are not supported (4 or 8)")
        self.bits, self.group_size = bits, group_size

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        self.init_layer(layer)
        layer.register_parameter("weight", None)
        layer.arrived = {}  # shard id -> {part name: checkpoint tensor}, until the shard has all its parts
        layer.shards = {}  # shard id -> (this rank's blocks or dense rows, the input order they follow or None)
        for part in self.PARTS:
            param = nn.Parameter(torch.empty(0), requires_grad=False)
            param.weight_loader = functools.partial(self._collect, layer, part)
            setattr(layer, part, param)

    def _collect(self, layer: nn.Module, part: str, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        dims = 1 if part == "g_idx" else 2
        kind_ok = loaded.is_floating_point() if part == "scales" else loaded.dtype == torch.int32
        if loaded.dim() != dims or not kind_ok:
            kind = "floating-point" if part == "scales" else "int32"
            raise ValueError(f"{self.name} {part} must be a {dims}-D {kind} tensor, got {loaded.dtype} "
                             f"{tuple(loaded.shape)}")
        parts = layer.arrived.setdefault(shard_id, {})
        parts[part] = loaded
        if len(parts) == len(self.PARTS):  # held as blocks at once: unpacked codes of every layer would not fit
            codes, scales, zeros, groups = self._this_rank(layer, shard_id, *self.unpack(layer.arrived.pop(shard_id)))
            order = torch.argsort(groups, stable=True) if bool((groups[1:] < groups[:-1]).any()) else None
            if order is not None:  # act-order: the columns sorted by group, so groups are contiguous
                codes, groups = codes[:, order], groups[order]
            layer.shards[shard_id] = (self._blocks(codes, scales, zeros, groups, layer), order)

    def unpack(self, parts: dict[str, torch.Tensor]):
        """-> codes [out, in], scales and zeros [out, groups] (float32), group of each input feature [in]."""
        raise NotImplementedError

    def check_groups(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> int:
        """The group size, after checking that scales and zeros have one column per group of the codes."""
        rows, cols = codes.shape
        group = cols if self.group_size == -1 else self.group_size
        want = (rows, -(-cols // group))
        for part, t in (("scales", scales), ("qzeros", zeros)):
            if tuple(t.shape) != want:
                raise ValueError(f"{self.name} {part} hold {tuple(t.shape)} (out, groups), but qweight has "
                                 f"{rows} outputs and {cols} inputs in groups of {group}: {want} expected")
        return group

    def _this_rank(self, layer: nn.Module, shard_id, codes, scales, zeros, groups):
        offset, size, start = layer.output_shard(shard_id)
        in_start, in_size = layer.input_shard()
        expected = layer.checkpoint_shape(shard_id)  # the whole weight, of which this rank keeps a part
        if tuple(codes.shape) != expected:
            where = "" if shard_id is None else f" (shard {shard_id})"
            raise ValueError(f"{self.name} weights unpack to {tuple(codes.shape)} (out, in); the model expects "
                             f"{expected}{where}")
        rows = slice(start, start + size)
        return (codes[rows, in_start:in_start + in_size], scales[rows], zeros[rows],
                groups[in_start:in_start + in_size])

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        orders = [order for _, order in layer.shards.values()]
        if any(not _same_order(order, orders[0]) for order in orders):
            raise ValueError(f"{self.name}: the fused projections of a {type(layer).__name__} have different "
                             "g_idx orders; qwenserve needs one input order per layer")
        layer.segments = [(layer.output_shard(shard_id)[0], segment) for shard_id, (segment, _) in layer.shards.items()]
        layer.input_order = None if orders[0] is None else orders[0].to(layer.weight_device)
        del layer.shards, layer.arrived
        super().process_weights_after_loading(layer)

    def _blocks(self, codes, scales, zeros, groups, layer: nn.Module):
        """codes [out, in] whose columns' groups are contiguous -> ggml blocks, or dense rows: without the kernels
        (the formula itself, exact), or when no block type fits (with a log line)."""
        packed = self._pack(codes, scales, zeros, groups) if layer.ggml_ops is not None else None
        if packed is not None:
            return packed
        if layer.ggml_ops is not None:
            logger.info("%s: a %s's groups do not fit ggml blocks; it is kept dense", self.name,
                        type(layer).__name__)
        return ((codes - zeros[:, groups]) * scales[:, groups]).to(layer.weight_dtype)

    def _pack(self, codes, scales, zeros, groups):
        """Q4_0 / Q4_1 / Q8_0 blocks holding exactly these codes, or None when none can."""
        if groups.numel() % BLOCK:
            return None
        blocks = groups.view(-1, BLOCK)
        if not bool((blocks == blocks[:, :1]).all()):  # a block would straddle two groups
            return None
        d, z = scales[:, blocks[:, 0]], zeros[:, blocks[:, 0]]
        if self.bits == 4:
            return pack_q4_0(codes, d) if bool((z == 8).all()) else pack_q4_1(codes, d, -z * d)
        if not bool((z == z.round()).all()):
            return None
        shifted = codes - z.repeat_interleave(BLOCK, 1)
        return pack_q8_0(shifted, d) if bool((shifted >= -128).all() and (shifted <= 127).all()) else None


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

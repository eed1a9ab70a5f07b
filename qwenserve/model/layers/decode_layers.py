"""A pipeline stage's decoder layers in one C++ call for decode-only steps (DecodeLayers in
kernels/cpu/decode_layers.cpp): the CPU's stand-in for a captured graph. The call runs the kernels the layer
modules would run, in their order, so the results are bit-identical; it saves the Python between them (a sixth of
a batch-1 step of the bundled model: docs/performance.md, "Decode layers in one call").

It applies where every part of every layer has a kernel: layers whose declared parts (decode_parts) are the ones
it runs (RUNS), with no parameter outside them; block-quantized projections that take ggml_mm at the
step's rows (every segment a kernel call, no input permutation), one tensor-parallel rank, a fixed 1-D rotary table
(not M-RoPE's [3, T] positions), a KV cache in the run dtype, and a step of decode tokens only, none of them under a
LoRA adapter. Anything else runs the modules, as does every step under enforce_eager. The layers' names are vLLM's
(input_layernorm, self_attn.qkv_proj, mlp.gate_up_proj, ...)."""
from __future__ import annotations

import torch
from torch import nn

from qwenserve.model.layers.attention import AttentionMetadata, PagedKVCache
from qwenserve.model.layers.rotary import MRotaryEmbedding

# add_segment's projection numbers
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# the layer parts (a decoder layer's decode_parts) DecodeLayers runs, in the order it runs them; the per-head q/k
# norms (Qwen3) are optional, together. A layer that names another part (an expert MLP) or holds a parameter
# outside its named parts runs through its modules.
RUNS = ("input_layernorm", "self_attn.qkv_proj", "self_attn.q_norm", "self_attn.k_norm", "self_attn.rotary_emb",
        "self_attn.attn", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn",
        "mlp.down_proj")
_HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def runs_every_part(layer: nn.Module) -> bool:
    """Whether DecodeLayers computes what the layer does: its declared parts are RUNS (with or without both head
    norms), in that order, and every parameter it holds lies in one of them (so a part the declaration forgot
    cannot be skipped silently)."""
    parts = tuple(getattr(layer, "decode_parts", ()))
    if parts not in (RUNS, tuple(p for p in RUNS if p not in _HEAD_NORMS)):
        return False
    return all(any(name.startswith(part + ".") for part in parts) for name, _ in layer.named_parameters())


def _projection(layer: nn.Module, path: str) -> nn.Module:
    """The linear layer at path; under a LoRA wrapper, the base layer it holds, which is all the wrapper runs in a
    step without adapters (the only steps that fuse)."""
    module = layer
    for name in path.split("."):
        module = getattr(module, name)
    return getattr(module, "base", module)


def _runs_on_kernel_calls(linear: nn.Module) -> bool:
    """Whether the projection's few-row path is nothing but its ggml_mm calls (GGMLBlockLinearMethod.apply)."""
    return (getattr(linear, "kernel_calls", None) is not None and getattr(linear, "input_order", 1) is None
            and linear.tp.size == 1
            and getattr(linear, "bias", None) is getattr(linear, "kernel_bias", None))


class FusedDecodeLayers:
    """Decides per step whether the stage's layers run as one DecodeLayers call, and builds that call's object once
    per KV cache."""

    def __init__(self, layers: list[nn.Module], ops):
        """layers: the stage's decoder layers; ops: the kernel library's ops namespace (None: never fused)."""
        self._layers = layers
        self._ops = ops
        self._max_rows: int | None = None  # decided at the first decode step, weights processed: 0 = never
        self._cache: PagedKVCache | None = None
        self._call = None

    def routes_changed(self) -> None:
        """Decide again at the next step: a projection's dense_from_rows changed after the first decode step."""
        self._max_rows = None

    def _rows_below(self) -> int:
        """Steps of fewer rows than this may fuse (the rows below which every projection takes ggml_mm); 0 when
        some part of a layer has no kernel."""
        if self._ops is None or not self._layers:
            return 0
        if not all(runs_every_part(layer) for layer in self._layers):
            return 0
        first = self._layers[0]
        rotary = first.self_attn.rotary_emb
        if rotary.dynamic or isinstance(rotary, MRotaryEmbedding):  # the call indexes one table by 1-D positions
            return 0
        linears = [_projection(layer, path) for layer in self._layers for path in _PROJECTIONS]
        if not all(_runs_on_kernel_calls(linear) for linear in linears):
            return 0
        if len({linear.act_levels for linear in linears}) != 1:
            return 0
        return min(linear.dense_from_rows for linear in linears)

    def _build(self, cache: PagedKVCache):
        first = self._layers[0]
        attn = first.self_attn
        call = getattr(torch.classes, self._ops.name).DecodeLayers(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, first.input_layernorm.eps, attn.attn.scale,
            _projection(first, _PROJECTIONS[0]).act_levels, attn.rotary_emb.cos_sin)
        for layer in self._layers:
            i = layer.self_attn.attn.layer_idx
            call.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, cache.k[i], cache.v[i])
            if _HEAD_NORMS[0] in layer.decode_parts:
                call.add_head_norms(layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)
            for number, path in enumerate(_PROJECTIONS):
                linear = _projection(layer, path)
                for rows_slice, raw, ggml_type, group, bias in linear.kernel_calls:
                    offset, rows = ((0, linear.output_size) if rows_slice is None
                                    else (rows_slice.start, rows_slice.stop - rows_slice.start))
                    call.add_segment(number, linear.output_size, raw, ggml_type, group, bias, offset, rows)
        return call

    def call_for(self, attn_metadata: AttentionMetadata, rows: int):
        """The DecodeLayers object to run this step with, or None when the modules must run it."""
        md = attn_metadata
        if md.prefills or len(md.decode) != 1 or md.decode[0].token_index is not None or md.lora is not None:
            return None
        if md.decode[0].context_lens is None or md.kv_cache.k_scales[0] is not None:
            return None
        if self._max_rows is None:
            self._max_rows = self._rows_below()
        if rows >= self._max_rows:
            return None
        if self._cache is not md.kv_cache:
            self._call, self._cache = self._build(md.kv_cache), md.kv_cache
        return self._call

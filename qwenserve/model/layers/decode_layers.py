"""A pipeline stage's decoder layers in one C++ call for decode-only steps (DecodeLayers in
kernels/cpu/decode_layers.cpp): the CPU's stand-in for a captured graph. The call runs the kernels the layer
modules would run, in their order, so the results are bit-identical; it saves the Python between them (a sixth of
a batch-1 step of the bundled model: docs/performance.md, "Decode layers in one call").

It applies where every part of every layer has a kernel: layers whose declared parts (decode_parts) are the ones it
runs (RUNS, or a mixture-of-experts MLP: MOE_MLP, with SHARED_EXPERT where there is one), with no parameter outside
them; block-quantized projections that take ggml_mm at the step's rows (every segment a kernel call, no input
permutation) or FP8 projections that take fp8_mm (no static input scale), experts kept as ggml blocks (moe.py's
block mode, run by ggml_moe; not the dense experts of a float checkpoint, nor FP8 experts), one tensor-parallel
rank, a fixed 1-D rotary table (not M-RoPE's [3, T] positions), a KV cache in the run dtype, and a step of decode
tokens only, none of them under a LoRA adapter. Anything else runs the modules, as does every step under
enforce_eager. The layers' names are vLLM's (input_layernorm, self_attn.qkv_proj, mlp.gate_up_proj, mlp.experts,
...)."""
from __future__ import annotations

import torch
from torch import nn

from qwenserve.model.layers.attention import AttentionMetadata, PagedKVCache
from qwenserve.model.layers.linear import WIDEN_IN_REGISTERS_BELOW_ROWS
from qwenserve.model.layers.moe import FusedExperts, TopKRouter
from qwenserve.model.layers.rotary import MRotaryEmbedding

# add_segment's projection numbers: 2 and 3 a dense MLP's, 4 and 5 a mixture-of-experts layer's shared expert's
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
                "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj")
# the layer parts (a decoder layer's decode_parts) DecodeLayers runs, in the order it runs them; the per-head q/k
# norms (Qwen3) are optional, together. A layer that names another part or holds a parameter outside its named
# parts runs through its modules.
RUNS = ("input_layernorm", "self_attn.qkv_proj", "self_attn.q_norm", "self_attn.k_norm", "self_attn.rotary_emb",
        "self_attn.attn", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn",
        "mlp.down_proj")
_HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_DENSE_MLP = RUNS[RUNS.index("mlp.gate_up_proj"):]
# a mixture-of-experts MLP (models/qwen2_moe.py's SparseMoeBlock) in place of the dense one: the router and the
# experts, then (Qwen2-MoE) the shared expert's MLP and its sigmoid gate
MOE_MLP = ("mlp.gate", "mlp.experts")
SHARED_EXPERT = ("mlp.shared_expert.gate_up_proj", "mlp.shared_expert.act_fn", "mlp.shared_expert.down_proj",
                 "mlp.shared_expert_gate")


def _declarations() -> tuple[tuple[str, ...], ...]:
    attention = RUNS[:RUNS.index("mlp.gate_up_proj")]
    without_norms = tuple(p for p in attention if p not in _HEAD_NORMS)
    return tuple(a + mlp for a in (attention, without_norms)
                 for mlp in (_DENSE_MLP, MOE_MLP, MOE_MLP + SHARED_EXPERT))


_RUNS_ANY = _declarations()


def runs_every_part(layer: nn.Module) -> bool:
    """Whether DecodeLayers computes what the layer does: its declared parts are RUNS (with or without both head
    norms; the dense MLP's parts or, in their place, MOE_MLP with or without SHARED_EXPERT), in that order, and
    every parameter it holds lies in one of them (so a part the declaration forgot cannot be skipped silently)."""
    parts = tuple(getattr(layer, "decode_parts", ()))
    if parts not in _RUNS_ANY:
        return False
    return all(any(name.startswith(part + ".") for part in parts) for name, _ in layer.named_parameters())


def _has_experts(layer: nn.Module) -> bool:
    return MOE_MLP[1] in layer.decode_parts


def _has_shared_expert(layer: nn.Module) -> bool:
    return SHARED_EXPERT[-1] in layer.decode_parts


def _projection_paths(layer: nn.Module) -> tuple[tuple[int, str], ...]:
    """(add_segment's number, path) of each linear projection the call runs in the layer."""
    numbered = tuple(enumerate(_PROJECTIONS))
    if not _has_experts(layer):
        return numbered[:4]
    return numbered[:2] + (numbered[4:] if _has_shared_expert(layer) else ())


def _experts_run_on_blocks(layer: nn.Module) -> bool:
    """Whether the layer's mixture-of-experts MLP is what the call runs: a top-k router, experts held as blocks
    for ggml_moe (not dense: a float checkpoint's), one tensor-parallel rank, and a shared expert gate without a
    bias, the shared expert's MLP taking one pass at the step's rows."""
    mlp = layer.mlp
    if not (isinstance(getattr(mlp, "gate", None), TopKRouter) and isinstance(getattr(mlp, "experts", None),
                                                                                FusedExperts)):
        return False
    experts = mlp.experts
    if (experts.blocks is None or experts.ops is None or experts.tp.size != 1
            or getattr(experts, "expert_parallel", False)):
        return False
    if _has_shared_expert(layer):
        gate = getattr(mlp, "shared_expert_gate", None)
        return isinstance(gate, nn.Linear) and gate.bias is None and mlp.shared_expert is not None
    return getattr(mlp, "shared_expert", None) is None


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


def _runs_on_fp8_mm(linear: nn.Module) -> bool:
    """Whether the projection's few-row path is one fp8_mm call (FP8LinearMethod.apply on our kernels, without a
    static input scale, whose quantizing of the input runs in Python)."""
    return (getattr(linear, "fp8_ops", None) is not None and getattr(linear, "fp8_input_scale", 0) is None
            and linear.tp.size == 1)


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

    def _linears(self) -> list[nn.Module]:
        return [_projection(layer, path) for layer in self._layers for _, path in _projection_paths(layer)]

    def _rows_below(self) -> int:
        """Steps of fewer rows than this may fuse (the rows below which every projection takes ggml_mm or fp8_mm);
        0 when some part of a layer has no kernel."""
        if self._ops is None or not self._layers:
            return 0
        if not all(runs_every_part(layer) for layer in self._layers):
            return 0
        if not all(_experts_run_on_blocks(layer) for layer in self._layers if _has_experts(layer)):
            return 0
        first = self._layers[0]
        rotary = first.self_attn.rotary_emb
        if rotary.dynamic or isinstance(rotary, MRotaryEmbedding):  # the call indexes one table by 1-D positions
            return 0
        linears = self._linears()
        blocks = [linear for linear in linears if _runs_on_kernel_calls(linear)]
        fp8 = [linear for linear in linears if _runs_on_fp8_mm(linear)]
        if len(blocks) + len(fp8) != len(linears):
            return 0
        if len({linear.act_levels for linear in blocks}) > 1:
            return 0
        below = min([linear.dense_from_rows for linear in blocks] + [WIDEN_IN_REGISTERS_BELOW_ROWS] * bool(fp8))
        # a shared expert's MLP (Qwen2MLP) splits more rows than rows_per_pass into passes: the call runs one
        shared = [layer.mlp.shared_expert.rows_per_pass + 1 for layer in self._layers if _has_shared_expert(layer)]
        return min([below] + shared)

    def _build(self, cache: PagedKVCache):
        first = self._layers[0]
        attn = first.self_attn
        act_levels = next((linear.act_levels for linear in self._linears() if _runs_on_kernel_calls(linear)), 1)
        call = getattr(torch.classes, self._ops.name).DecodeLayers(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, first.input_layernorm.eps, attn.attn.scale,
            act_levels, attn.rotary_emb.cos_sin)
        for layer in self._layers:
            i = layer.self_attn.attn.layer_idx
            call.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, cache.k[i], cache.v[i])
            if _HEAD_NORMS[0] in layer.decode_parts:
                call.add_head_norms(layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)
            if _has_experts(layer):
                router, experts = layer.mlp.gate, layer.mlp.experts
                b = experts.blocks
                call.add_experts(router.weight, router.top_k, router.renormalize, b.gate, b.gate_type, b.up,
                                 b.up_type, b.down, b.down_type, b.group, experts.act_levels)
                if _has_shared_expert(layer):
                    call.add_shared_expert(layer.mlp.shared_expert_gate.weight)
            for number, path in _projection_paths(layer):
                linear = _projection(layer, path)
                if _runs_on_fp8_mm(linear):
                    call.add_fp8_projection(number, linear.weight.view(torch.uint8), linear.fp8_scales,
                                            linear.fp8_group, linear.bias)
                    continue
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

"""`qwenserve bench kernels`: every weight shape of the loaded model at M = 1, 16, 128, 1024 rows, our layer's
matmul against the alternatives, as GB/s of weight bytes read and GFLOP/s, beside the machine's read bandwidth and
its int8 roof: the rate of a register-only loop of the int8 multiply-adds our tile kernels run (the kernel
variant's `int8_roof` op, kernels/cpu/roof.cpp), per core and on all threads.

Rows: one per distinct (layer kind, block types, out x in) of the model. Columns per M:
- `ours`: the layer's own apply (ggml_mm on its blocks, or dequantize + dense from dense_from_rows rows);
- `ours_in_turn`: the same, each call on the next of the model's layers of that shape, as a decode step reads
  them: one layer called again and again may be served from a large L3, these are read from memory wherever the
  model is larger than the caches;
- `dense`: F.linear on a dense weight in the run dtype (oneDNN-packed where bf16 packing is available);
- `fp32`: F.linear in float32;
- `int8pack`: torch's `_weight_int8pack_mm` (int8 per output channel);
- `int4pack`: torch's `_weight_int4pack_mm_for_cpu` (int4, groups of 128) where the shape allows;
- `fp8`: FP8 e4m3 codes with a scale per 128x128 block, as Qwen's FP8 checkpoints hold them, on the FP8 linear
  path (fp8_mm for few rows, matmuls on widened slices for many).
GB/s counts the bytes of weight each variant reads per call (its own format); decode (M=1) is bound by them.
A mixture of experts' layers add a row `experts` (ours and ours_in_turn only): the layer's experts on their blocks
(ggml_moe) for M tokens routed to k experts each, chosen uniformly at random as random router weights choose them;
GB/s counts the chosen experts' bytes (each distinct expert once), GFLOP/s the k experts' three projections.
`% roof`, from ROOF_MIN_ROWS rows, where the tile kernels run: `ours`' GFLOP/s (2 M N K) over the all-threads roof in
GOP/s (2 per int8 multiply-add), how far the layer is from what the int8 instructions allow; the roof leaves out
the weight decoding, scaling and float sums the quantized layers also do."""
from __future__ import annotations

import itertools
import time

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from qwenserve.config.engine_config import EngineConfig
from qwenserve.kernels import cpu_ops_for, use_cpu_kernels
from qwenserve.model.layers.linear import cpu_weight_packing_available, widened_linear, widening_ops
from qwenserve.model.layers.moe import FusedExperts, TopKRouter
from qwenserve.model.layers.quantization.fp8 import ONLINE_BLOCK, fp8_linear, fp8_ops, quantize_blocks
from qwenserve.model.loader.ggml_tensor import GGMLTensor
from qwenserve.model.loader.model_loader import load_model
from qwenserve.model.loader.resolve import resolve_model

# decode, and prefill chunks at the sizes the tile kernels are tuned for (16, 128) and beyond (1024)
ROWS = (1, 16, 128, 1024)
# below this many rows the layers run the one-row and few-row dot products, which the roof does not describe
ROOF_MIN_ROWS = 16


def timed(fn, min_seconds: float = 0.3, max_calls: int = 200) -> float:
    """Seconds per call: one warm-up call, then calls until min_seconds have passed (at least one)."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < max_calls:
        fn()
        calls += 1
        if time.perf_counter() - start >= min_seconds:
            break
    return (time.perf_counter() - start) / calls


def read_bandwidth(gib: float = 1.0) -> float:
    """GB/s of a multi-threaded sum over a buffer far larger than the caches."""
    buf = torch.ones(int(gib * (1 << 30)) // 4)
    seconds = min(timed(buf.sum, min_seconds=0.5) for _ in range(3))
    return buf.numel() * 4 / seconds / 1e9


def int8_roof(seconds: float = 0.3) -> dict | None:
    """The chosen kernel variant's int8 roof: the instructions its loop ran, GOP/s on one thread and on all of
    torch's threads, and the same for the AMX tile multiplies where ggml_mm runs them; None without our kernels."""
    ops = cpu_ops_for("cpu")
    if ops is None:
        return None
    per_core, all_threads, name = ops.int8_roof(0, seconds)
    roof = {"instructions": name, "per_core_GOPs": _figure(per_core), "all_threads_GOPs": _figure(all_threads)}
    if ops.ggml_amx_tiles():
        per_core, all_threads, name = ops.int8_roof(0, seconds, True)
        roof["amx"] = {"instructions": name, "per_core_GOPs": _figure(per_core),
                       "all_threads_GOPs": _figure(all_threads)}
    return roof


def weight_shapes(model) -> dict[tuple, list[torch.nn.Module]]:
    """(kind, block types, out, in) -> every layer of that shape, in the model's order."""
    shapes = {}
    for name, module in model.named_modules():
        if not hasattr(module, "linear_method"):
            continue
        kind = name.split(".")[-1]
        shapes.setdefault((kind, _weight_types(module), module.output_size, module.input_size), []).append(module)
    return shapes


def expert_layers(model) -> list[tuple[TopKRouter, FusedExperts]]:
    """Each mixture-of-experts layer's router and experts, where the experts run on their blocks."""
    return [(m.gate, m.experts) for m in model.modules()
            if isinstance(getattr(m, "gate", None), TopKRouter) and isinstance(getattr(m, "experts", None),
                                                                                FusedExperts)
            and m.experts.blocks is not None]


def _expert_entries(layers: list[tuple[TopKRouter, FusedExperts]], rows: tuple[int, ...], dtype) -> list[dict]:
    """`experts` rows of the table: one layer's experts, and each layer's in turn, at M tokens (module docstring)."""
    router, experts = layers[0]
    blocks, k = experts.blocks, router.top_k
    types = "/".join(GGMLQuantizationType(t).name for t in (blocks.gate_type, blocks.down_type))
    hidden, inter = blocks.down.shape[1], blocks.gate.shape[1] // (2 if blocks.up is None else 1)  # gate+up fused
    per_expert = sum(t[0].nbytes for t in (blocks.gate, blocks.up, blocks.down) if t is not None)
    results = []
    for m in rows:
        x = torch.randn(m, hidden).to(dtype)
        ids = torch.rand(m, experts.num_experts).topk(k, dim=-1).indices
        weights = torch.softmax(torch.randn(m, k), dim=-1).to(dtype)
        nbytes = per_expert * ids.unique().numel()
        turn = itertools.cycle(e for _, e in layers)
        calls = {"ours": lambda: experts(x, weights, ids), "ours_in_turn": lambda: next(turn)(x, weights, ids)}
        entry = {"layer": "experts", "types": f"{types}, {k} of {experts.num_experts}", "out": hidden,
                 "in": inter, "M": m, "layers": len(layers)}
        for name, fn in calls.items():
            seconds = timed(fn)
            entry[name] = {"ms": _figure(seconds * 1e3), "GB/s": _figure(nbytes / seconds / 1e9),
                           "GFLOP/s": _figure(2 * m * k * 3 * hidden * inter / seconds / 1e9)}
        results.append(entry)
    return results


def _weight_types(module) -> str:
    """How the table names a layer's weights: its segments' block types, float8_e4m3fn for FP8 codes, else dense."""
    segments = getattr(module, "segments", None)
    if segments:
        return "+".join(s.ggml_type.name if isinstance(s, GGMLTensor) else str(s.dtype).removeprefix("torch.")
                        for _, s in segments)
    weight = getattr(module, "weight", None)
    return str(weight.dtype).removeprefix("torch.") if weight is not None and weight.dtype.itemsize == 1 else "dense"


def _alternatives(out_features: int, in_features: int, dtype: torch.dtype) -> dict:
    """name -> (fn(x), weight bytes per call) on random weights of this shape."""
    w = torch.randn(out_features, in_features) * 0.02
    dense = w.to(dtype)
    alts = {"fp32": (lambda x: F.linear(x.float(), w), w.numel() * 4)}
    if cpu_weight_packing_available(dense):
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, 32)
        alts["dense"] = (lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                         dense.numel() * dense.element_size())
    elif (widening := widening_ops(dense)) is not None:  # as a dense checkpoint runs where bf16 is not native
        alts["dense"] = (lambda x: widened_linear(widening, dense, x, None), dense.numel() * dense.element_size())
    else:
        alts["dense"] = (lambda x: F.linear(x, dense), dense.numel() * dense.element_size())
    scale = (w.abs().amax(1) / 127).to(dtype)
    codes = torch.randint(-127, 128, w.shape, dtype=torch.int8)
    alts["int8pack"] = (lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, scale), codes.numel() + out_features * 2)
    if in_features % 128 == 0 and out_features % 16 == 0:  # what the int4 packing accepts
        q4 = torch.randint(0, 16, w.shape, dtype=torch.int32)
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        scales_zeros = torch.rand(in_features // 128, out_features, 2).to(dtype)
        alts["int4pack"] = (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, 128, scales_zeros),
                            packed4.numel() + scales_zeros.numel() * scales_zeros.element_size())
    fp8_codes, block_scales = quantize_blocks(w, ONLINE_BLOCK)
    fp8_scales = block_scales.repeat_interleave(ONLINE_BLOCK[0], 0)[:out_features].contiguous()  # as layers hold them
    fp8_kernels = fp8_ops(w.device)
    alts["fp8"] = (lambda x: fp8_linear(fp8_kernels, fp8_codes, fp8_scales, ONLINE_BLOCK[1], x),
                   fp8_codes.numel() + fp8_scales.numel() * 4)
    return alts


def _apply(module, x: torch.Tensor) -> torch.Tensor:
    return module.linear_method.apply(module, x, None)


def _each_in_turn(modules: list[torch.nn.Module]):
    """A call that applies the next of these layers each time."""
    turn = itertools.cycle(modules)
    return lambda x: _apply(next(turn), x)


def layer_bytes(module) -> int:
    segments = getattr(module, "segments", None)
    if segments:
        return sum(s.nbytes if isinstance(s, GGMLTensor) else s.numel() * s.element_size() for _, s in segments)
    weight = module.weight if module.weight is not None else module.packed_weight
    scales = getattr(module, "fp8_scales", None)  # an FP8 layer reads its scales beside its codes
    scale_bytes = scales.numel() * scales.element_size() if scales is not None else 0
    return weight.numel() * weight.element_size() + scale_bytes


def bench_kernels(config: EngineConfig, rows: tuple[int, ...] = ROWS) -> dict:
    load = config.load
    resolved = resolve_model(load)
    with use_cpu_kernels(load.cpu_kernels, load.cpu_isa):
        model = load_model(resolved, load.device)
        roof = int8_roof() if torch.device(load.device).type == "cpu" else None
    bandwidth = read_bandwidth()
    results = []
    with torch.inference_mode():
        for (kind, types, out_features, in_features), modules in weight_shapes(model).items():
            alts = _alternatives(out_features, in_features, resolved.dtype)
            size = layer_bytes(modules[0])
            ours = {"ours": (lambda x, m=modules[0]: _apply(m, x), size),
                    "ours_in_turn": (_each_in_turn(modules), size)}
            for m in rows:
                x = torch.randn(m, in_features).to(resolved.dtype)
                entry = {"layer": kind, "types": types, "out": out_features, "in": in_features, "M": m,
                         "layers": len(modules)}
                for name, (fn, nbytes) in {**ours, **alts}.items():
                    seconds = timed(lambda: fn(x))
                    entry[name] = {"ms": _figure(seconds * 1e3), "GB/s": _figure(nbytes / seconds / 1e9),
                                   "GFLOP/s": _figure(2 * m * out_features * in_features / seconds / 1e9)}
                if roof is not None and m >= ROOF_MIN_ROWS:
                    entry["% roof"] = _figure(100 * entry["ours"]["GFLOP/s"] / roof["all_threads_GOPs"])
                results.append(entry)
        if layers := expert_layers(model):
            results += _expert_entries(layers, rows, resolved.dtype)
    return {"quantization": resolved.quantization, "dtype": str(resolved.dtype).removeprefix("torch."),
            "read_bandwidth_GBps": round(bandwidth, 2), "int8_roof": roof, "threads": torch.get_num_threads(),
            "shapes": results}


def _figure(value: float) -> float:
    """Three significant digits: a fixed number of decimals turned a tiny layer's figures on a busy machine
    into 0.0."""
    return float(f"{value:.3g}")


def format_table(result: dict) -> str:
    names = ["ours", "ours_in_turn", "dense", "fp32", "int8pack", "int4pack", "fp8"]
    lines = [f"quantization {result['quantization']}, dtype {result['dtype']}, {result['threads']} threads, "
             f"measured read bandwidth {result['read_bandwidth_GBps']} GB/s, {_roof_line(result.get('int8_roof'))}",
             "ms per call (GB/s of weights read | GFLOP/s); % roof: ours' GFLOP/s over the all-threads int8 roof",
             "| layer | types | out x in (layers) | M | " + " | ".join(names) + " | % roof |",
             "|---" * (5 + len(names)) + "|"]
    for e in result["shapes"]:
        cells = [f"{e[n]['ms']} ({e[n]['GB/s']} \\| {e[n]['GFLOP/s']})" if n in e else "-" for n in names]
        cells.append(str(e["% roof"]) if "% roof" in e else "-")
        lines.append(f"| {e['layer']} | {e['types']} | {e['out']} x {e['in']} ({e['layers']}) | {e['M']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _roof_line(roof: dict | None) -> str:
    if roof is None:
        return "int8 roof: - (no CPU kernels)"
    line = (f"int8 roof {roof['per_core_GOPs']} GOP/s per core, {roof['all_threads_GOPs']} GOP/s all threads "
            f"({roof['instructions']})")
    if "amx" in roof:
        amx = roof["amx"]
        line += f", AMX {amx['per_core_GOPs']} / {amx['all_threads_GOPs']} GOP/s ({amx['instructions']})"
    return line

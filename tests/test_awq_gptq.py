"""quantization="awq" / "gptq": checkpoints in the layouts of Qwen2.5-*-AWQ and Qwen2.5-*-GPTQ-Int4/Int8, none of
which can be downloaded here, so the tests write tiny ones, packing random integer codes exactly as the formats'
own writers do:
- AWQ: AutoAWQ, awq/modules/linear/gemm.py `WQLinear_GEMM.from_linear` (intweight transposed to [in, out], eight
  4-bit codes per int32 along the outputs, nibble i holding column order_map[i] = [0, 2, 4, 6, 1, 3, 5, 7][i];
  qzeros packed the same way; scales [in / group, out] fp16).
- GPTQ: AutoGPTQ, auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py `QuantLinear.pack` (qweight packed along the
  inputs, 32 / bits codes per int32, lowest bits first; zeros minus one, packed along the outputs; g_idx the
  group of each input, scattered when desc_act quantized the columns in another order).
Checked: (a) the unpacked codes, zeros and scales are the ones packed and the loaded layer's weight is the
formula's (q - zero) * scale; (b) the model's logits equal the same model run dense on the dequantized weights."""
import json
import os

import pytest
import torch
from helpers import dense_route_from, save_hf_dir, tiny_hf_model
from safetensors.torch import load_file, save_file

from qwenserve import LLM, SamplingParams, kernels
from qwenserve.config.errors import ConfigError
from qwenserve.model.layers.quantization.awq import AWQLinearMethod
from qwenserve.model.layers.quantization.gptq import GPTQLinearMethod
from qwenserve.model.loader.ggml_tensor import GGMLTensor
from qwenserve.model.loader.model_loader import LoadedModel, WeightLoadError
from qwenserve.worker.model_runner import full_logits

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]
INPUT_OF = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}
PROJECTIONS = tuple(INPUT_OF)


def quantize(weight, bits, group, sym=False, act_order_seed=None):
    """Round-to-nearest codes [out, in], fp16 scales and integer zeros [out, groups] and the group of each input,
    as AutoAWQ / AutoGPTQ compute them before packing (sym: zero at the middle code). With act_order_seed the
    inputs are taken in a random order, `group` at a time, as GPTQ's desc_act does."""
    out_features, in_features = weight.shape
    g_idx = torch.arange(in_features) // group
    if act_order_seed is not None:
        order = torch.randperm(in_features, generator=torch.Generator().manual_seed(act_order_seed))
        g_idx = torch.empty_like(g_idx)
        g_idx[order] = torch.arange(in_features) // group
    maxq = (1 << bits) - 1
    groups = [weight[:, g_idx == j] for j in range(in_features // group)]
    if sym:
        scales = torch.stack([2 * w.abs().amax(1) / maxq for w in groups], 1).half().float()
        zeros = torch.full_like(scales, (maxq + 1) // 2)
    else:
        low = torch.stack([w.amin(1) for w in groups], 1)
        scales = ((torch.stack([w.amax(1) for w in groups], 1) - low) / maxq).half().float()
        zeros = (-low / scales).round().clamp(0, maxq)
    codes = (weight / scales[:, g_idx] + zeros[:, g_idx]).round().clamp(0, maxq).long()
    return codes, scales, zeros, g_idx


def dequantized(codes, scales, zeros, g_idx):
    return (codes - zeros[:, g_idx]) * scales[:, g_idx]


def awq_pack(codes, scales, zeros):
    """As WQLinear_GEMM.from_linear: [out, in] codes -> qweight [in, out / 8]; zeros [out, groups] ->
    qzeros [groups, out / 8]; scales -> [groups, out] fp16."""
    def pack(values):  # [rows, cols] -> [rows, cols / 8], along cols, interleaved
        values = values.to(torch.int32)
        packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
        for col in range(values.shape[1] // 8):
            for i in range(8):
                packed[:, col] |= values[:, col * 8 + AWQ_ORDER_MAP[i]] << (i * 4)
        return packed
    return {"qweight": pack(codes.t()), "qzeros": pack(zeros.t()), "scales": scales.t().half().contiguous()}


def gptq_pack(codes, scales, zeros, g_idx, bits):
    """As QuantLinear.pack (v1 format: zeros stored minus one)."""
    per_word = 32 // bits
    intweight = codes.t().to(torch.int64)  # [in, out]
    qweight = torch.zeros(intweight.shape[0] // per_word, intweight.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(per_word):
            qweight[row] |= intweight[row * per_word + j] << (bits * j)
    stored = (zeros.t().to(torch.int64) - 1) & ((1 << bits) - 1)  # [groups, out]
    qzeros = torch.zeros(stored.shape[0], stored.shape[1] // per_word, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(per_word):
            qzeros[:, col] |= stored[:, col * per_word + j] << (bits * j)
    as_int32 = lambda t: (t & 0xFFFFFFFF).to(torch.int64).apply_(lambda v: v - (1 << 32) if v >= 1 << 31 else v) \
        .to(torch.int32)
    return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": scales.t().half().contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def write_quantized(tmp_path, method, bits=4, group=64, sym=False, act_order=False, seed=70):
    """(quantized checkpoint dir, dense checkpoint dir of the same model on the dequantized weights)."""
    hf = tiny_hf_model(seed=seed, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2)
    dense_dir = save_hf_dir(hf, str(tmp_path / f"{method}-dense"))
    quant_dir = save_hf_dir(hf, str(tmp_path / method))
    dense_state = load_file(os.path.join(dense_dir, "model.safetensors"))
    quant_state = {}
    for name, tensor in dense_state.items():
        prefix = name[:-len(".weight")]
        projection = prefix.split(".")[-1]
        if not (name.endswith(".weight") and projection in PROJECTIONS):
            quant_state[name] = tensor.half() if method == "awq" else tensor
            continue
        # projections of one input (q, k, v; gate, up) share GPTQ's column order, as they share its statistics
        layer = int(prefix.split(".")[2])
        act_order_seed = 4 * layer + INPUT_OF[projection] if act_order else None
        parts = quantize(tensor, bits, group, sym, act_order_seed)
        dense_state[name] = dequantized(*parts).float()
        packed = awq_pack(*parts[:3]) if method == "awq" else gptq_pack(*parts, bits)
        quant_state.update({f"{prefix}.{part}": t for part, t in packed.items()})
    save_file(dense_state, os.path.join(dense_dir, "model.safetensors"))
    save_file(quant_state, os.path.join(quant_dir, "model.safetensors"))
    config_path = os.path.join(quant_dir, "config.json")
    config = json.load(open(config_path))
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": bits, "group_size": group, "version": "gemm", "zero_point": True}
        if method == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym})
    json.dump(config, open(config_path, "w"))
    return quant_dir, dense_dir


def random_weight(out_features, in_features, seed):
    return 0.08 * torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


def test_awq_unpack_returns_the_packed_codes():
    codes, scales, zeros, g_idx = quantize(random_weight(24, 128, 1), 4, 64)
    got = AWQLinearMethod(4, 64).unpack(awq_pack(codes, scales, zeros))
    for a, b in zip(got, (codes, scales, zeros, g_idx)):
        assert torch.equal(a, b.to(a.dtype))


@pytest.mark.parametrize("bits, act_order", [(4, False), (4, True), (8, False)])
def test_gptq_unpack_returns_the_packed_codes(bits, act_order):
    codes, scales, zeros, g_idx = quantize(random_weight(16, 128, 2), bits, 32, act_order_seed=3 if act_order else None)
    got = GPTQLinearMethod(bits, 32).unpack(gptq_pack(codes, scales, zeros, g_idx, bits))
    for a, b in zip(got, (codes, scales, zeros, g_idx)):
        assert torch.equal(a, b.to(a.dtype))


def layer_weights(model):
    """{name: dense weight} of every quantized projection, from its blocks (dequantized) or dense segments."""
    out = {}
    for name, module in model.named_modules():
        if getattr(module, "segments", None):
            rows = [s.dequantize() if isinstance(s, GGMLTensor) else s for _, s in module.segments]
            weight = torch.cat(rows)
            if module.input_order is not None:
                weight[:, module.input_order] = weight.clone()
            out[name] = weight
    return out


CASES = {  # id: (method, bits, group, sym, act_order, block type the layers should hold)
    "awq-4bit-g64": ("awq", 4, 64, False, False, "Q4_1"),
    "gptq-4bit-sym-g64": ("gptq", 4, 64, True, False, "Q4_0"),
    "gptq-4bit-asym-act-order-g32": ("gptq", 4, 32, False, True, "Q4_1"),
    "gptq-8bit-sym-g128": ("gptq", 8, 128, True, False, "Q8_0"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_loaded_weights_follow_the_formula_and_logits_the_dense_model(ops, tmp_path, case):
    method, bits, group, sym, act_order, block_type = CASES[case]
    quant_dir, dense_dir = write_quantized(tmp_path, method, bits, group, sym, act_order)
    quantized = LoadedModel(quant_dir, dtype="float32", quantization=None)  # detected from config.json
    assert quantized.resolved_model.quantization == method
    exact = LoadedModel(dense_dir, dtype="float32", quantization="none").model
    model = quantized.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert [s.ggml_type.name for _, s in qkv.segments] == [block_type]  # q, k and v merged: one block type
    assert (qkv.input_order is not None) == act_order

    # (a) the held weights are (q - zero) * scale: exactly for Q4_0 and Q8_0; Q4_1 holds m = -zero * scale in
    # fp16, within 2^-11 of it
    exact_only = block_type != "Q4_1"
    dense_params = dict(exact.named_parameters())
    for name, weight in layer_weights(model).items():
        want = dense_params[f"{name}.weight"]
        if exact_only:
            assert torch.equal(weight, want), name
        else:
            torch.testing.assert_close(weight, want, atol=2e-4, rtol=0)

    # (b) logits: prefill-sized batches run the dequantized blocks dense, decode-sized ones int8 dot products
    many = list(range(3, 3 + dense_route_from(model) + 6))
    tol = 1e-4 if exact_only else 1e-2
    torch.testing.assert_close(full_logits(model, many), full_logits(exact, many), atol=tol, rtol=tol)
    few = list(range(9, 41))
    got, want = full_logits(model, few), full_logits(exact, few)
    assert (got - want).norm() < 0.05 * want.norm()


@pytest.mark.slow
def test_without_kernels_the_weights_are_dense_from_the_formula(tmp_path):
    quant_dir, dense_dir = write_quantized(tmp_path, "gptq", 4, 32, act_order=True)
    with kernels.disabled():
        model = LoadedModel(quant_dir, dtype="float32", quantization="gptq").model
        exact = LoadedModel(dense_dir, dtype="float32", quantization="none").model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.segments is None and qkv.weight.shape == (256, 128)
    ids = list(range(5, 30))
    torch.testing.assert_close(full_logits(model, ids), full_logits(exact, ids))


@pytest.mark.slow
def test_engine_generates_from_an_awq_checkpoint(ops, tmp_path):
    quant_dir, dense_dir = write_quantized(tmp_path, "awq")
    prompts = ["the cat", "in the"]
    params = SamplingParams(max_tokens=8, temperature=0)
    got = LLM(quant_dir, dtype="float32", kv_cache_memory="4MiB").generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in got)


def test_bad_checkpoints_name_the_tensor(tmp_path):
    quant_dir, _ = write_quantized(tmp_path, "awq")
    path = os.path.join(quant_dir, "model.safetensors")
    state = load_file(path)
    state["model.layers.1.mlp.down_proj.scales"] = state["model.layers.1.mlp.down_proj.scales"][:1]
    save_file(state, path)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.\w+: awq scales hold \(128, 1\)"):
        LoadedModel(quant_dir, dtype="float32", quantization="awq")
    state["model.layers.1.mlp.down_proj.scales"] = torch.zeros(4, 128, dtype=torch.int32)
    save_file(state, path)
    with pytest.raises(WeightLoadError, match=r"down_proj\.scales: awq scales must be a 2-D floating-point"):
        LoadedModel(quant_dir, dtype="float32", quantization="awq")
    with pytest.raises(ConfigError, match="AWQ checkpoint: it runs with quantization awq only, not int8"):
        LLM(quant_dir, quantization="int8")
    config_path = os.path.join(quant_dir, "config.json")
    config = json.load(open(config_path))
    config["quantization_config"]["bits"] = 3
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ConfigError, match="awq: 3-bit weights are not supported"):
        LoadedModel(quant_dir, dtype="float32", quantization="awq")

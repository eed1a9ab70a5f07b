"""quantization="int8" / "int4": a dense checkpoint (or a GGUF file, dequantized) quantized at load by rounding
to nearest: int8 with one scale per output channel, int4 with a scale and an offset per group of 128 inputs,
held as Q8_0 / Q4_1 blocks the ggml kernels run. Checked against the formulas, against the dense model, and
through the engine."""
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from helpers import dense_route_from, save_gguf, save_hf_dir, tiny_hf_model

from qwenserve import LLM, SamplingParams, kernels
from qwenserve.model.loader.ggml_tensor import GGMLTensor
from qwenserve.model.loader.model_loader import LoadedModel
from qwenserve.worker.model_runner import full_logits

SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf_dir(tiny_hf_model(seed=81, **SIZES), str(tmp_path_factory.mktemp("int") / "hf"))


def quantized_layers(model):
    return {name: m for name, m in model.named_modules() if getattr(m, "segments", None)}


def test_int8_is_per_output_channel_round_to_nearest(ops, hf_dir):
    exact = dict(LoadedModel(hf_dir, dtype="float32", quantization="none").model.named_parameters())
    model = LoadedModel(hf_dir, dtype="float32", quantization="int8").model
    layers = quantized_layers(model)
    assert "lm_head" in layers and len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    for name, layer in layers.items():
        (offset, blocks), = layer.segments
        assert isinstance(blocks, GGMLTensor) and blocks.ggml_type.name == "Q8_0" and layer.weight.numel() == 0
        weight = exact[f"{name}.weight"]
        raw = blocks.in_file_layout().raw  # (held in the decode layout: rows in groups of 8)
        d = raw.view(weight.shape[0], -1, 34)[..., :2].contiguous().view(torch.float16).float().squeeze(-1)
        want_d = (weight.abs().amax(1) / 127).half().float()
        assert torch.equal(d, want_d.unsqueeze(1).expand_as(d)), "one scale per output channel"
        want = (weight / want_d[:, None]).round().clamp(-127, 127) * want_d[:, None]
        torch.testing.assert_close(blocks.dequantize(), want, atol=1e-7, rtol=0)


def test_int4_is_groups_of_128_with_an_offset_and_the_head_stays_int8(ops, hf_dir):
    exact = dict(LoadedModel(hf_dir, dtype="float32", quantization="none").model.named_parameters())
    model = LoadedModel(hf_dir, dtype="float32", quantization="int4").model
    assert model.lm_head.segments[0][1].ggml_type.name == "Q8_0"
    down = model.model.layers[0].mlp.down_proj
    blocks = down.segments[0][1]
    assert blocks.ggml_type.name == "Q4_1"
    assert blocks.nbytes == 256 * 128 * GGML_QUANT_SIZES[blocks.ggml_type][1] // 32  # 5 bits per weight
    weight = exact["model.layers.0.mlp.down_proj.weight"]
    groups = weight.view(128, 2, 128)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d, m = ((high - low) / 15).half().float(), low.half().float()
    want = (((groups - m) / d).round().clamp(0, 15) * d + m).view(128, 256)
    torch.testing.assert_close(blocks.dequantize(), want, atol=1e-6, rtol=0)
    assert ((blocks.dequantize() - weight).abs() <= d.repeat_interleave(128, 1).view(128, 256) * 0.5 + 1e-3).all()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_logits_equal_the_dense_model_on_the_rounded_weights(ops, hf_dir, method):
    model = LoadedModel(hf_dir, dtype="float32", quantization=method).model
    rounded = LoadedModel(hf_dir, dtype="float32", quantization="none").model
    params = dict(rounded.named_parameters())
    with torch.no_grad():
        for name, layer in quantized_layers(model).items():
            params[f"{name}.weight"].copy_(layer.segments[0][1].dequantize())
    # prefill-sized: the blocks are dequantized and run dense, as the rounded dense model runs
    many = list(range(3, 3 + dense_route_from(model) + 6))
    torch.testing.assert_close(full_logits(model, many), full_logits(rounded, many), atol=1e-4, rtol=1e-4)
    # decode-sized: int8 dot products on activations quantized per block of 32
    few = list(range(9, 41))
    got, want = full_logits(model, few), full_logits(rounded, few)
    assert (got - want).norm() < 0.05 * want.norm()


@pytest.mark.slow
def test_from_a_gguf_file_and_through_the_engine(ops, tmp_path):
    path = save_gguf(tiny_hf_model(seed=82, **SIZES), str(tmp_path / "m.gguf"), "Q8_0")
    prompts = [{"prompt_token_ids": list(range(10, 30))}, {"prompt_token_ids": list(range(40, 47))}]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for method in ("int8", "int4"):
        llm = LLM(path, dtype="float32", quantization=method, kv_cache_memory="4MiB")
        assert llm.engine.resolved_model.quantization == method
        outputs[method] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert all(len(ids) == 12 for method in outputs for ids in outputs[method])


def test_without_kernels_the_rounded_weights_run_dense(hf_dir):
    with kernels.disabled():
        model = LoadedModel(hf_dir, dtype="float32", quantization="int8").model
    down = model.model.layers[1].mlp.down_proj
    assert down.segments is None and down.weight.shape == (128, 256)
    exact = LoadedModel(hf_dir, dtype="float32", quantization="none").model.model.layers[1].mlp.down_proj.weight
    d = (exact.abs().amax(1, keepdim=True) / 127).half().float()
    torch.testing.assert_close(down.weight, (exact / d).round() * d, atol=1e-7, rtol=0)


def test_int4_needs_groups_of_128(tmp_path):
    small = save_hf_dir(tiny_hf_model(seed=83), str(tmp_path / "small"))  # hidden size 64
    with pytest.raises(ValueError, match="int4: QKVParallelLinear has 64 input features, not a multiple of the "
                                         "quantization group of 128"):
        LLM(small, quantization="int4")

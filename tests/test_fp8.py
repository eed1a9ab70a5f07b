"""quantization="fp8" / "compressed-tensors": FP8 checkpoints written here as the published formats are, from tiny
random models (none of the real ones can be downloaded here):
- block-wise, as Qwen/Qwen3-*-FP8: config.json quantization_config {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, each projection's `weight` in float8_e4m3fn
  and a float32 `weight_scale_inv` [ceil(out / 128), ceil(in / 128)] (weight = code * scale_inv per block);
- per-tensor and per-channel, as vLLM's fp8 method reads them (AutoFP8 and others): `weight_scale` of shape [] or
  [out, 1], and with activation_scheme static an `input_scale` of shape [];
- compressed-tensors' float-quantized format (llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK schemes):
  config_groups with weights {num_bits 8, type float, strategy tensor / channel / block}, `weight_scale` [1],
  [out, 1] or [out / 128, in / 128], `input_scale` [1] where the input activations are static.
The models' sizes are not multiples of 128, so the scale blocks at the edges are partial.

The reference is the HF model holding the exact dequantized values (code * scale in float32), in float32, its
inputs quantized as a static input scale says where the checkpoint has one: the logits must match it closely."""
import json
import os

import pytest
import torch
from helpers import (assert_hf_greedy, assert_seeded_samples_agree, fused_steps, greedy_tokens,  # noqa: F401
                     save_hf_dir, tiny_hf_model, tiny_qwen3)
from safetensors.torch import load_file, save_file

from qwenserve import LLM, SamplingParams
from qwenserve.config.errors import ConfigError
from qwenserve.model.loader.model_loader import LoadedModel, WeightLoadError
from qwenserve.worker.model_runner import full_logits

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3 = torch.float8_e4m3fn
IDS = list(range(5, 40))
BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def qwen3():
    """Hidden 192 (1.5 blocks), q 192, k / v 96, intermediate 320 (2.5 blocks): every matrix has edge blocks."""
    return tiny_qwen3(11, hidden_size=192, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=48)


def qwen2():
    """Qwen2 (q/k/v biases), hidden 160, intermediate 288."""
    return tiny_hf_model(seed=12, hidden_size=160, intermediate_size=288, num_attention_heads=5,
                         num_key_value_heads=1)


# ---- the formats, written here from their definitions ----------------------------------------------------------

def block_codes(weight, bn=128, bk=128):
    """-> (e4m3 codes, float32 scales [ceil(N / bn), ceil(K / bk)]), one scale per block: amax / 448."""
    n, k = weight.shape
    scales = torch.empty(-(-n // bn), -(-k // bk))
    codes = torch.empty(n, k, dtype=E4M3)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scales[i, j] = block.abs().max() / 448
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / scales[i, j]).to(E4M3)
    return codes, scales


def block_values(codes, scales, bn=128, bk=128):
    out = torch.empty(codes.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[rows, cols] = codes[rows, cols].float() * scales[i, j]
    return out


def input_amax(hf, ids=IDS):
    """The largest |input| of each projection (module name -> float) over a calibration prompt."""
    amax, hooks = {}, []
    for name, module in hf.named_modules():
        if name.split(".")[-1] in PROJECTIONS:
            hooks.append(module.register_forward_pre_hook(lambda m, args, name=name: amax.__setitem__(
                name, max(amax.get(name, 0.0), args[0].abs().max().item()))))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


def quantize_state(hf, dense, kind, ignore=()):
    """dense: the checkpoint's tensors as saved -> (FP8 checkpoint tensors, the same with the dequantized float32
    weights, static input scales by module)."""
    state = dict(dense)
    reference = dict(state)
    amax = input_amax(hf) if kind in ("tensor-static", "ct-tensor-static") else {}
    input_scales = {}
    for name, weight in dense.items():
        module = name[:-len(".weight")]
        if not (name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS) or module in ignore:
            continue
        if kind in ("block", "ct-block"):
            codes, scales = block_codes(weight)
            values = block_values(codes, scales)
            scale_name = "weight_scale_inv" if kind == "block" else "weight_scale"
        elif kind in ("tensor-static", "ct-tensor-static"):
            scales = weight.abs().max() / 448  # shape []
            codes = (weight / scales).to(E4M3)
            values = codes.float() * scales
            scales = scales.reshape(1) if kind.startswith("ct") else scales
            scale_name = "weight_scale"
        else:  # channel, ct-channel
            scales = weight.abs().amax(1, keepdim=True) / 448  # [out, 1]
            codes = (weight / scales).to(E4M3)
            values = codes.float() * scales
            scale_name = "weight_scale"
        state[name] = codes
        state[f"{module}.{scale_name}"] = scales.float().contiguous()
        reference[name] = values
        if module in amax:
            input_scales[module] = torch.tensor(amax[module] / 448)
            state[f"{module}.input_scale"] = input_scales[module].reshape(1) if kind.startswith("ct") \
                else input_scales[module]
    return state, reference, input_scales


def ct_config(strategy, static_input=False, ignore=("lm_head",)):
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
               "observer": "minmax"}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    inputs = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
              if static_input else
              {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
            "ignore": list(ignore), "kv_cache_scheme": None}


CONFIGS = {
    "block": BLOCK_CONFIG,
    "tensor-static": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"},
    "channel": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
    "ct-block": ct_config("block"),
    "ct-channel": ct_config("channel"),
    "ct-tensor-static": ct_config("tensor", static_input=True),
}


def write_fp8(path, hf, kind, ignore=(), config=None):
    """An FP8 checkpoint of hf at path; returns the reference (a float32 HF model on the dequantized weights, with
    hooks that quantize its inputs where the checkpoint has static input scales)."""
    from transformers import AutoModelForCausalLM
    save_hf_dir(hf, str(path))
    file = os.path.join(path, "model.safetensors")
    state, reference, input_scales = quantize_state(hf, load_file(file), kind, ignore)
    save_file(state, file)
    reference_dir = save_hf_dir(hf, f"{path}-reference")
    save_file(reference, os.path.join(reference_dir, "model.safetensors"))
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        raw = json.load(f)
    raw["quantization_config"] = config or CONFIGS[kind]
    with open(config_path, "w") as f:
        json.dump(raw, f)
    ref = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    for name, module in ref.named_modules():
        if name in input_scales:
            scale = input_scales[name].item()
            module.register_forward_pre_hook(
                lambda m, args, s=scale: ((args[0] / s).clamp(-448, 448).to(E4M3).float() * s,))
    return ref


def hf_logits(hf, ids=IDS):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def projection(model, layer, name):
    block = model.model.layers[layer]
    return getattr(block.self_attn if name in ("qkv_proj", "o_proj") else block.mlp, name)


def test_dequantize_is_code_times_scale_in_float32_for_every_code():
    """dequantize reads the codes' bits as float32 (not torch's conversion): every finite e4m3 code, edge groups, a
    scale too large for that trick, all bit for bit as code.float() * scale."""
    from qwenserve.model.layers.quantization.fp8 import dequantize
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3)
    finite = every[every.float().isfinite()]  # 254: 0x7f and 0xff are NaN
    codes = finite.repeat(300)[:300 * 254].view(300, 254)
    for group in (128, 254, 100):
        scales = torch.rand(300, -(-254 // group)) * 3e-3 + 1e-7
        want = codes.float() * scales.repeat_interleave(group, 1)[:, :254]
        assert torch.equal(dequantize(codes, scales, group, torch.float32), want)
        assert torch.equal(dequantize(codes, scales, group, torch.bfloat16), want.bfloat16())
    large = torch.full((300, 1), 300.0)
    assert torch.equal(dequantize(codes, large, 254, torch.float32), codes.float() * 300.0)


# ---- checkpoints ------------------------------------------------------------------------------------------------

def test_block_fp8_checkpoint_matches_its_dequantized_weights(tmp_path):
    ref = write_fp8(tmp_path / "block", qwen3(), "block")
    model = LoadedModel(str(tmp_path / "block"), dtype="float32", quantization=None).model  # fp8 from config.json
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        layer = projection(model, 1, name)
        assert layer.weight.dtype == E4M3 and layer.weight.element_size() == 1
    # the LM head, embedding and norms keep the checkpoint's dtype (float32 here)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    assert model.model.norm.weight.dtype == torch.float32
    torch.testing.assert_close(full_logits(model, IDS), hf_logits(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["tensor-static", "channel", "ct-block", "ct-channel", "ct-tensor-static"])
def test_per_tensor_per_channel_and_compressed_tensors_match_their_dequantized_weights(tmp_path, kind):
    hf = qwen3() if kind == "ct-block" else qwen2()
    ref = write_fp8(tmp_path / kind, hf, kind)
    model = LoadedModel(str(tmp_path / kind), dtype="float32", quantization=None).model
    assert projection(model, 0, "down_proj").weight.dtype == E4M3
    static = "static" in kind
    assert (projection(model, 0, "qkv_proj").fp8_input_scale is not None) == static
    torch.testing.assert_close(full_logits(model, IDS), hf_logits(ref), atol=2e-5, rtol=1e-5)


def test_static_input_scales_change_the_result(tmp_path):
    """The static path is taken: the same checkpoint run with its activations unquantized differs."""
    ref = write_fp8(tmp_path / "static", qwen2(), "tensor-static")
    model = LoadedModel(str(tmp_path / "static"), dtype="float32", quantization=None).model
    with_scales = full_logits(model, IDS)
    for i in range(2):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            projection(model, i, name).fp8_input_scale = None
    assert (full_logits(model, IDS) - with_scales).abs().max() > 1e-3
    torch.testing.assert_close(with_scales, hf_logits(ref), atol=2e-5, rtol=1e-5)


def test_static_input_scales_keep_decode_on_the_modules(ops, tmp_path, fused_steps):
    """The one-call decode runs fp8_mm on unquantized inputs, so layers with static input scales decode through the
    modules (which quantize the inputs), answering as enforce_eager does; a dynamic checkpoint takes the call."""
    write_fp8(tmp_path / "static", qwen2(), "tensor-static")
    write_fp8(tmp_path / "block", qwen2(), "block")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": IDS[:9]}, {"prompt_token_ids": IDS[3:20]}]

    def tokens(path, eager):
        llm = LLM(model=str(path), dtype="float32", enforce_eager=eager, max_model_len=128)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    static = tokens(tmp_path / "static", eager=False)
    assert fused_steps and not any(fused_steps)
    assert static == tokens(tmp_path / "static", eager=True)
    fused_steps.clear()
    tokens(tmp_path / "block", eager=False)
    assert max(fused_steps) == len(prompts)


def test_bf16_run_of_a_block_checkpoint_is_close(tmp_path):
    ref = write_fp8(tmp_path / "block", qwen3(), "block")
    model = LoadedModel(str(tmp_path / "block"), dtype="bfloat16", quantization="fp8").model
    got, want = full_logits(model, IDS), hf_logits(ref)
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_ignored_layers_stay_dense(tmp_path):
    ignore = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
              "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj")
    config = dict(BLOCK_CONFIG, ignored_layers=list(ignore))
    ref = write_fp8(tmp_path / "ignored", qwen3(), "block", ignore=ignore, config=config)
    model = LoadedModel(str(tmp_path / "ignored"), dtype="float32", quantization=None).model
    assert projection(model, 0, "qkv_proj").weight.dtype == torch.float32
    assert projection(model, 1, "down_proj").weight.dtype == torch.float32
    assert projection(model, 1, "qkv_proj").weight.dtype == E4M3
    assert projection(model, 0, "down_proj").weight.dtype == E4M3
    torch.testing.assert_close(full_logits(model, IDS), hf_logits(ref), atol=2e-5, rtol=1e-5)


def test_a_fused_layer_is_ignored_whole_or_not_at_all(tmp_path):
    config = dict(BLOCK_CONFIG, ignored_layers=["model.layers.0.self_attn.q_proj"])
    write_fp8(tmp_path / "half", qwen3(), "block", ignore=("model.layers.0.self_attn.q_proj",), config=config)
    with pytest.raises(ValueError, match=r"fp8: quantization_config leaves model\.layers\.0\.self_attn\.q_proj "
                                         r"unquantized but not model\.layers\.0\.self_attn\.k_proj, "
                                         r"model\.layers\.0\.self_attn\.v_proj; qwenserve holds them as one fused"):
        LoadedModel(str(tmp_path / "half"), dtype="float32", quantization=None)


def test_compressed_tensors_ignore_takes_regular_expressions(tmp_path):
    hf = qwen2()
    ignore = tuple(f"model.layers.{i}.mlp.down_proj" for i in range(2))
    ref = write_fp8(tmp_path / "ct", hf, "ct-channel", ignore=ignore,
                    config=ct_config("channel", ignore=("lm_head", "re:.*down_proj$")))
    model = LoadedModel(str(tmp_path / "ct"), dtype="float32", quantization=None).model
    assert projection(model, 1, "down_proj").weight.dtype == torch.float32
    assert projection(model, 1, "gate_up_proj").weight.dtype == E4M3
    torch.testing.assert_close(full_logits(model, IDS), hf_logits(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("names", ["published", "transformers5"])
def test_qwen2_5_vl_checkpoint_with_its_tower_and_a_layer_left_dense(tmp_path, names):
    """Qwen2.5-VL as llm-compressor writes it in FP8: the language model's projections block-wise, the vision tower
    (whose MLP has gate / up / down_proj too) and one language layer left dense by the ignore list, whose names are
    the checkpoint's own (as published, or transformers 5's model.language_model.* / model.visual.*). Text logits are
    the HF model's on the dequantized weights."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from vl_helpers import save_hf_vl_dir, tiny_hf_vl_model
    hf = tiny_hf_vl_model("qwen2_5_vl", seed=3)
    path = save_hf_vl_dir(hf, str(tmp_path / "vl"))
    file = os.path.join(path, "model.safetensors")
    dense = load_file(file)
    tower = tuple(name.removesuffix(".weight") for name in dense if name.startswith("visual."))
    state, reference, _ = quantize_state(hf, dense, "ct-block", ignore=tower + ("model.layers.0.mlp.down_proj",))
    assert any(name.startswith("visual.") and name.endswith("gate_proj.weight") for name in dense)
    ignore = ("lm_head", "re:visual.*", "model.layers.0.mlp.down_proj")
    if names == "transformers5":
        rename = {"model.": "model.language_model.", "visual.": "model.visual."}
        state = {next((new + name[len(old):] for old, new in rename.items() if name.startswith(old)), name): tensor
                 for name, tensor in state.items()}
        ignore = ("lm_head", "re:model.visual.*", "model.language_model.layers.0.mlp.down_proj")
    save_file(state, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = ct_config("block", ignore=ignore)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    reference_dir = save_hf_vl_dir(hf, str(tmp_path / "reference"))
    save_file(reference, os.path.join(reference_dir, "model.safetensors"))
    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(reference_dir, dtype=torch.float32).eval()

    model = LoadedModel(path, dtype="float32", quantization=None).model
    assert projection(model, 0, "down_proj").weight.dtype == torch.float32
    assert projection(model, 1, "down_proj").weight.dtype == E4M3
    assert projection(model, 0, "gate_up_proj").weight.dtype == E4M3
    torch.testing.assert_close(full_logits(model, IDS), hf_logits(ref), atol=2e-5, rtol=1e-5)

def test_a_qwen2_vl_checkpoint_with_an_fp8_tower_is_refused(tmp_path):
    from vl_helpers import save_hf_vl_dir, tiny_hf_vl_model
    hf = tiny_hf_vl_model("qwen2_5_vl", seed=3)
    path = save_hf_vl_dir(hf, str(tmp_path / "vl"))
    file = os.path.join(path, "model.safetensors")
    save_file(quantize_state(hf, load_file(file), "block")[0], file)  # the tower's gate / up / down_proj too
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = BLOCK_CONFIG
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ConfigError, match=r"visual\.blocks\.0\.mlp\.\w+_proj\.weight_scale_inv: the checkpoint "
                                           r"quantizes the vision tower, which qwenserve runs dense"):
        LoadedModel(path, dtype="float32", quantization=None)


def test_engine_greedy_tokens_are_the_reference_models(tmp_path):
    ref = write_fp8(tmp_path / "block", qwen3(), "block")
    llm = LLM(str(tmp_path / "block"), dtype="float32", kv_cache_memory="8MiB")
    prompts = [list(range(3 + i, 14 + 3 * i)) for i in range(3)]
    assert_hf_greedy(ref, prompts, greedy_tokens(llm, prompts))


def test_lora_adapters_on_fp8_layers_match_peft_on_the_dequantized_weights(tmp_path):
    """A PEFT adapter on all seven projections of an FP8 checkpoint's model: qwenserve's greedy tokens and logits (the
    FP8 layers on our kernels, the adapter's products added to theirs) are PEFT's on the dequantized reference, in a
    batch beside a request without the adapter, which stays the base model's."""
    from test_lora import ATTENTION, MLP, make_adapter, reference

    from qwenserve import LoRARequest
    ref = write_fp8(tmp_path / "block", qwen3(), "block")
    peft_model = make_adapter(ref, str(tmp_path / "adapter"), seed=3, r=4, lora_alpha=8,
                              target_modules=ATTENTION + MLP)
    llm = LLM(str(tmp_path / "block"), dtype="float32", kv_cache_memory="8MiB", record_logits=True,
              enable_lora=True, max_lora_rank=4)
    prompts = [list(range(3, 40)), list(range(7, 12))]  # a prompt past 32 rows (prefill's route) and a short one
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    adapter = LoRARequest("fp8-adapter", 1, str(tmp_path / "adapter"))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts[:1]], params, use_tqdm=False,
                        lora_request=[adapter, adapter, None])
    for out, ids, model in zip(outs, prompts + prompts[:1], [peft_model, peft_model, ref]):
        with torch.no_grad():
            tokens, logits = reference(model, ids, params.max_tokens)
        assert out.outputs[0].token_ids == tokens
        torch.testing.assert_close(torch.stack(out.outputs[0].logits), logits, atol=2e-4, rtol=0)
    assert not torch.equal(outs[0].outputs[0].logits[0], outs[2].outputs[0].logits[0])


def test_seeded_samples_of_an_fp8_checkpoint_are_the_modules_and_independent_of_the_batch(ops, tmp_path,
                                                                                           fused_steps):
    """Seeded sampling (n=3, temperature, top_p) in bf16 on a block FP8 checkpoint, its 40-token prompt long enough
    for prefill's route (fp8_mm's tiles where the CPU has AVX512-BF16): the one-call decode draws the modules' samples
    (enforce_eager), the three samples differ, and the request draws the same tokens alone and beside others."""
    write_fp8(tmp_path / "block", qwen3(), "block")
    seeded = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_tokens=12, seed=5, ignore_eos=True)
    noisy = SamplingParams(temperature=1.2, max_tokens=12, ignore_eos=True)
    prompts = [list(range(3, 43)), list(range(20, 60)), list(range(7, 19))]

    def samples(eager, with_others):
        llm = LLM(str(tmp_path / "block"), dtype="bfloat16", kv_cache_memory="8MiB", enforce_eager=eager)
        requests = [{"prompt_token_ids": p} for p in (prompts if with_others else prompts[1:2])]
        outs = llm.generate(requests, [noisy, seeded, noisy] if with_others else [seeded], use_tqdm=False)
        return [list(c.token_ids) for c in outs[1 if with_others else 0].outputs]
    assert_seeded_samples_agree(samples, fused_steps)


def fp8_moe(kind):
    """A tiny MoE model whose experts' shapes leave partial 128x128 blocks (160 and 192)."""
    from test_moe import tiny_moe
    extra = dict(head_dim=48) if kind == "qwen3_moe" else dict(shared_expert_intermediate_size=192)
    return tiny_moe(kind, seed=13, hidden_size=192, moe_intermediate_size=160, intermediate_size=320,
                    num_hidden_layers=2, num_experts=4, norm_topk_prob=True, **extra)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_fp8_experts_match_their_dequantized_weights(tmp_path, kind):
    """Qwen3-30B-A3B-FP8's layout: every expert's gate / up / down projection block-wise FP8, the router dense."""
    hf = fp8_moe(kind)
    ref = write_fp8(tmp_path / kind, hf, "block")
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in load_file(
        os.path.join(tmp_path / kind, "model.safetensors"))
    model = LoadedModel(str(tmp_path / kind), dtype="float32", quantization=None).model
    experts = model.model.layers[0].mlp.experts
    assert experts.w13.dtype == E4M3 and experts.w2.dtype == E4M3
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32
    torch.testing.assert_close(full_logits(model, IDS), hf_logits(ref), atol=2e-5, rtol=1e-5)


def expert_projections(layers=2, experts=4):
    return tuple(f"model.layers.{layer}.mlp.experts.{e}.{proj}" for layer in range(layers) for e in range(experts)
                 for proj in ("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize("kind, config", [
    ("block", dict(BLOCK_CONFIG, ignored_layers=list(expert_projections()))),
    ("ct-channel", ct_config("channel", ignore=("lm_head", r"re:.*mlp\.experts\..*"))),
    # static input scales on every other layer: the experts, left dense, take none
    ("ct-tensor-static", ct_config("tensor", static_input=True, ignore=("lm_head", r"re:.*mlp\.experts\..*"))),
])
def test_experts_the_config_leaves_unquantized_load_dense(tmp_path, kind, config):
    """An FP8 checkpoint whose ignored_layers / ignore name every expert projection holds them dense: they load dense,
    as any ignored layer does, the other layers in FP8."""
    ref = write_fp8(tmp_path / kind, fp8_moe("qwen3_moe"), kind, ignore=expert_projections(), config=config)
    model = LoadedModel(str(tmp_path / kind), dtype="float32", quantization=None).model
    experts = model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.float32 and experts.w2.dtype == torch.float32
    assert projection(model, 0, "qkv_proj").weight.dtype == E4M3
    torch.testing.assert_close(full_logits(model, IDS), hf_logits(ref), atol=2e-5, rtol=1e-5)


def test_experts_are_left_unquantized_all_or_none(tmp_path):
    """One expert of a layer left unquantized is refused, naming it and the others (one layer's experts are held in
    one format); experts kept in FP8 with static input scales still are."""
    some = expert_projections(layers=1, experts=1)
    write_fp8(tmp_path / "some", fp8_moe("qwen3_moe"), "block", ignore=some,
              config=dict(BLOCK_CONFIG, ignored_layers=list(some)))
    experts = r"model\.layers\.0\.mlp\.experts"
    with pytest.raises(ValueError, match=rf"fp8: quantization_config leaves {experts}\.0\.gate_proj, "
                                         rf"{experts}\.0\.up_proj, {experts}\.0\.down_proj unquantized but not "
                                         rf"{experts}\.1\.gate_proj, .* and 5 more; qwenserve holds a layer's experts "
                                         r"in one format"):
        LoadedModel(str(tmp_path / "some"), dtype="float32", quantization=None)
    write_fp8(tmp_path / "static", fp8_moe("qwen3_moe"), "ct-tensor-static")
    with pytest.raises(ValueError, match="compressed-tensors: experts with static input scales are not supported"):
        LoadedModel(str(tmp_path / "static"), dtype="float32", quantization=None)


def test_experts_wider_than_the_config_are_refused(tmp_path):
    """Experts 160 wide under a config.json of moe_intermediate_size 144: the 128x128 scale grids have the same shape
    either way, and the codes used to be cut to fit."""
    path = str(tmp_path / "wide")
    write_fp8(path, fp8_moe("qwen3_moe"), "block")
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["moe_intermediate_size"] = 144
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight: expert down "
                                              r"weight has shape \(192, 160\), the model expects \(192, 144\)"):
        LoadedModel(path, dtype="float32", quantization=None)


@pytest.mark.slow
def test_tensor_parallel_ranks_load_their_slices_of_codes_and_scales(tmp_path):
    """At 2 ranks each rank's rows and columns of the codes and of the 128x128 scale grid; the row-parallel inputs
    split at a block boundary (256 and 512 columns)."""
    from helpers import tensor_parallel_logits
    hf = tiny_qwen3(14, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64)
    ref = write_fp8(tmp_path / "tp", hf, "block")
    results = tensor_parallel_logits(str(tmp_path / "tp"), 2, IDS, quantization="fp8")
    for rank in range(2):
        torch.testing.assert_close(torch.from_numpy(results[rank]), hf_logits(ref), atol=1e-4, rtol=1e-4)


# ---- online ---------------------------------------------------------------------------------------------------

def test_online_fp8_quantizes_each_checkpoint_tensor_as_a_block_checkpoint_holds_it(tmp_path, monkeypatch):
    from qwenserve.model.layers.quantization import fp8
    hf = qwen3()
    dense = save_hf_dir(hf, str(tmp_path / "dense"))
    quantized = []
    real = fp8.quantize_blocks

    def recording(weight, block):  # what is held in full precision while quantizing: one checkpoint tensor
        quantized.append(tuple(weight.shape))
        return real(weight, block)
    monkeypatch.setattr(fp8, "quantize_blocks", recording)
    model = LoadedModel(dense, dtype="float32", quantization="fp8").model
    projections = {tuple(t.shape) for name, t in load_file(os.path.join(dense, "model.safetensors")).items()
                   if name.split(".")[-2] in PROJECTIONS and name.endswith(".weight")}
    assert len(quantized) == 14 and set(quantized) == projections  # 7 projections x 2 layers, each once
    for i in range(2):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert projection(model, i, name).weight.dtype == E4M3
    assert model.lm_head.weight.dtype == torch.float32
    # the codes and scales are a block-wise checkpoint's: the same logits as the model on those dequantized weights
    got = full_logits(model, IDS)
    torch.testing.assert_close(got, hf_logits(write_fp8(tmp_path / "block", hf, "block")), atol=2e-5, rtol=1e-5)
    want = full_logits(LoadedModel(dense, dtype="float32", quantization="none").model, IDS)
    assert_close_to_unquantized(got, want)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_online_fp8_quantizes_experts_as_a_block_checkpoint_holds_them(tmp_path, kind):
    """--quantization fp8 on a dense mixture-of-experts checkpoint: each expert's gate, up and down become e4m3
    codes as they load (one byte a weight, no dense copy kept), giving the logits of the model on the dequantized
    weights of the block-wise checkpoint written from the same model, and staying close to the unquantized model."""
    hf = fp8_moe(kind)
    dense = save_hf_dir(hf, str(tmp_path / "dense"))
    model = LoadedModel(dense, dtype="float32", quantization="fp8").model
    experts = model.model.layers[0].mlp.experts
    assert experts.w13.dtype == E4M3 and experts.w2.dtype == E4M3
    assert experts.s13.shape == (4, 2 * 160, 2) and experts.s2.shape == (4, 192, 2)  # per row, 128-column groups
    got = full_logits(model, IDS)
    torch.testing.assert_close(got, hf_logits(write_fp8(tmp_path / "block", hf, "block")), atol=2e-5, rtol=1e-5)
    # most positions as close as a dense model's (measured: median cosine 0.995, top token kept at 77-80%); at a few
    # a router near a tie picks another expert after FP8's rounding, so no bound on the worst one
    want = full_logits(LoadedModel(dense, dtype="float32", quantization="none").model, IDS)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.7
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).median() > 0.985


@pytest.mark.multiproc
@pytest.mark.parametrize("source", ["block", "online"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_fp8_experts_split_over_two_ranks_equal_one_process(tmp_path, source, expert_parallel):
    """Qwen2-MoE (shared expert included) with FP8 experts, a block checkpoint's or quantized at load, over two
    tensor-parallel ranks (every expert's FFN split) or two expert-parallel ranks (whole experts): every rank's
    logits are one process's. The row-parallel inputs split at a block boundary (128 of 256 columns), as block
    scales need (test_a_rank_refuses_block_scales_split_inside_a_block)."""
    from helpers import PROMPTS, tensor_parallel_logits
    from test_moe import tiny_moe
    hf = tiny_moe("qwen2_moe", seed=13, hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                  num_hidden_layers=2, num_experts=4, num_attention_heads=4, num_key_value_heads=2,
                  norm_topk_prob=True)
    if source == "block":
        write_fp8(tmp_path / "m", hf, "block")
        path, quantization = str(tmp_path / "m"), "fp8"
    else:
        path, quantization = save_hf_dir(hf, str(tmp_path / "m")), "fp8"
    expected = full_logits(LoadedModel(path, dtype="float32", quantization=quantization).model, PROMPTS[3])
    results = tensor_parallel_logits(path, 2, PROMPTS[3], quantization, expert_parallel=expert_parallel)
    for rank in range(2):
        torch.testing.assert_close(torch.from_numpy(results[rank]), expected, atol=1e-4, rtol=1e-4)


def test_a_rank_refuses_block_scales_split_inside_a_block():
    """Columns 80-159 of a block checkpoint (experts of 160 inputs at tensor_parallel_size 2) would start inside a
    128-column scale block: the rank refuses, saying what to choose."""
    from qwenserve.model.layers.quantization.fp8 import FP8Config, fill_scales
    config = FP8Config.from_fp8_config(BLOCK_CONFIG)
    with pytest.raises(ValueError, match="input columns start at 80, inside a 128-column scale block: choose a "
                                         "tensor_parallel_size"):
        fill_scales(config, torch.zeros(192, 1), torch.ones(2, 2), 0, 192, 0, 80, 80, exact=False)


def test_online_quantization_of_a_ranks_part_is_the_whole_tensors():
    """A tensor-parallel rank's part of a dense tensor, quantized at load: rows cut anywhere and columns cut at a block
    boundary hold exactly the codes and scales one process makes of the whole tensor; columns cut inside a block are
    quantized as a tensor of their own (their groups cannot be the whole tensor's blocks)."""
    from qwenserve.model.layers.quantization.fp8 import quantize_online, quantize_online_slice
    weight = torch.randn(320, 300, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.1, 3, 320)[:, None]
    codes, scales = quantize_online(weight, (128, 128))
    for rows, cols in ((slice(64, 128), slice(0, 300)), (slice(96, 224), slice(128, 300)),
                       (slice(0, 320), slice(0, 128)), (slice(250, 320), slice(128, 256))):
        got_codes, got_scales = quantize_online_slice(weight, rows, cols, (128, 128))
        groups = -(-(cols.stop - cols.start) // 128)
        assert torch.equal(got_codes, codes[rows, cols]), (rows, cols)
        assert torch.equal(got_scales, scales[rows, cols.start // 128:cols.start // 128 + groups]), (rows, cols)
    alone = quantize_online(weight[64:128, 80:160], (128, 128))
    got = quantize_online_slice(weight, slice(64, 128), slice(80, 160), (128, 128))
    assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])


def test_online_fp8_in_bf16_is_close_to_bf16(tmp_path):
    dense = save_hf_dir(qwen3(), str(tmp_path / "dense"))
    got = full_logits(LoadedModel(dense, dtype="bfloat16", quantization="fp8").model, IDS)
    want = full_logits(LoadedModel(dense, dtype="bfloat16", quantization="none").model, IDS)
    assert_close_to_unquantized(got, want)


def assert_close_to_unquantized(got, want):
    """FP8's rounding (3 mantissa bits) on a random tiny model, whose logits are nearly flat: measured 83% (fp32) and
    89% (bf16) of the positions keep their top token, cosine 0.993; wrong scales or codes fall far below."""
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.985


# ---- errors ---------------------------------------------------------------------------------------------------

def _rewrite(path, change_state=None, change_config=None):
    file = os.path.join(path, "model.safetensors")
    if change_state:
        state = load_file(file)
        change_state(state)
        save_file(state, file)
    if change_config:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        change_config(raw["quantization_config"])
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f)


def test_bad_checkpoints_name_the_problem_and_the_file(tmp_path):
    path = str(tmp_path / "bad")
    write_fp8(path, qwen3(), "block")
    down = "model.layers.1.mlp.down_proj"
    _rewrite(path, change_config=lambda c: c.update(fmt="e5m2"))
    with pytest.raises(ConfigError, match=rf"{path}: quantization_config fmt 'e5m2' is not supported"):
        LoadedModel(path, dtype="float32", quantization=None)
    _rewrite(path, change_config=lambda c: c.update(fmt="e4m3"))

    good = load_file(os.path.join(path, "model.safetensors"))
    _rewrite(path, lambda s: s.__setitem__(f"{down}.weight_scale_inv", s[f"{down}.weight_scale_inv"][:1]))
    with pytest.raises(WeightLoadError, match=rf"{path}: {down}\.weight_scale_inv: weight_scale_inv has shape "
                                              r"\(1, 3\); 128x128 blocks of 192 rows and 320 columns need \(2, 3\)"):
        LoadedModel(path, dtype="float32", quantization=None)
    _rewrite(path, lambda s: s.pop(f"{down}.weight_scale_inv"))
    with pytest.raises(WeightLoadError, match=rf"{path}: .*missing tensors: {down}\.weight_scale_inv"):
        LoadedModel(path, dtype="float32", quantization=None)
    _rewrite(path, lambda s: (s.update(good), s.__setitem__(f"{down}.weight", s[f"{down}.weight"].float()
                                                             .to(torch.float8_e5m2))))
    with pytest.raises(WeightLoadError, match=rf"{down}\.weight: fp8 weight is torch\.float8_e5m2, not float8_e4m3fn"):
        LoadedModel(path, dtype="float32", quantization=None)
    _rewrite(path, lambda s: s.__setitem__(f"{down}.weight", s[f"{down}.weight"].float().bfloat16()))
    with pytest.raises(WeightLoadError, match=r"weight is torch\.bfloat16, not float8_e4m3fn \(a layer stored "
                                              r"unquantized must be named in the quantization_config's ignored_layers"):
        LoadedModel(path, dtype="float32", quantization=None)
    with pytest.raises(ConfigError, match=rf"{path} is a FP8 checkpoint: it runs with quantization fp8 only, not int8"):
        LoadedModel(path, dtype="float32", quantization="int8")


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(format="pack-quantized"), "format 'pack-quantized' is not supported"),
    (lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int"),
     r"config_groups\.group_0\.weights are 4-bit int; qwenserve loads 8-bit float \(FP8\) weights"),
    (lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="group"),
     "weights strategy 'group' is not supported"),
])
def test_unsupported_compressed_tensors_configs_are_refused(tmp_path, change, message):
    path = str(tmp_path / "ct")
    write_fp8(path, qwen2(), "ct-channel")
    _rewrite(path, change_config=change)
    with pytest.raises(ConfigError, match=rf"{path}: compressed-tensors .*{message}"):
        LoadedModel(path, dtype="float32", quantization=None)


def test_wrong_compressed_tensors_scale_shape_is_refused(tmp_path):
    path = str(tmp_path / "ct")
    write_fp8(path, qwen2(), "ct-channel")
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    _rewrite(path, lambda s: s.__setitem__(name, s[name][:1, 0]))
    with pytest.raises(WeightLoadError, match=rf"{name}: weight_scale has shape \(1,\); strategy channel needs one "
                                              r"value per output row, \[160, 1\]"):
        LoadedModel(path, dtype="float32", quantization=None)


# ---- KV cache scales ----------------------------------------------------------------------------------------------

def prefill_cache(model, dtype, ids=IDS):
    """The KV cache (one slot per token, slot i = token i) after one prefill of ids."""
    from qwenserve.model.layers.attention import AttentionMetadata, PagedKVCache, PrefillSpan
    spec = model.kv_cache_spec()
    cache = PagedKVCache(spec.num_layers, -(-len(ids) // 16), 16, spec.num_kv_heads, spec.head_dim, dtype)
    positions = torch.arange(len(ids))
    keys = {}
    hooks = [layer.self_attn.attn.register_forward_pre_hook(
        lambda m, args, i=i: keys.__setitem__(i, (args[1].clone(), args[2].clone())))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.tensor(ids), positions, AttentionMetadata(cache, positions, [], [PrefillSpan(0, len(ids), None,
                                                                                                 len(ids))]))
    for h in hooks:
        h.remove()
    return cache, keys


def written(cache, layer, n=len(IDS)):
    """(k codes, v codes, k scales, v scales) of the first n slots."""
    return tuple(t.view(-1, *t.shape[2:])[:n] for t in (cache.k[layer], cache.v[layer], cache.k_scales[layer],
                                                         cache.v_scales[layer]))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_checkpoint_kv_scales_are_the_caches_scales(tmp_path, cache_dtype):
    path = str(tmp_path / "kv")
    write_fp8(path, qwen3(), "block")
    k0, v0, kv1 = (torch.tensor(value) for value in (0.011, 0.007, 0.009))  # float32, as checkpoints hold them
    # vLLM's names, and the older one for both
    scales = {"model.layers.0.self_attn.k_scale": k0, "model.layers.0.self_attn.v_scale": v0,
              "model.layers.1.self_attn.kv_scale": kv1}
    _rewrite(path, lambda s: s.update(scales))
    model = LoadedModel(path, dtype="float32", quantization=None).model
    assert model.model.layers[0].self_attn.attn.kv_scales == (k0.item(), v0.item())
    assert model.model.layers[1].self_attn.attn.kv_scales == (kv1.item(), kv1.item())
    cache, kv = prefill_cache(model, cache_dtype)
    top = torch.finfo(cache_dtype).max if cache_dtype.is_floating_point else 127
    for layer, (k_scale, v_scale) in enumerate([(k0.item(), v0.item()), (kv1.item(), kv1.item())]):
        k_codes, v_codes, k_scales, v_scales = written(cache, layer)
        for codes, stored, x, checkpoint_scale in ((k_codes, k_scales, kv[layer][0], k_scale),
                                                   (v_codes, v_scales, kv[layer][1], v_scale)):
            scale = torch.tensor(checkpoint_scale * 448 / top).bfloat16()  # e4m3's range stretched to the dtype's
            assert (stored == scale).all()
            want = (x / scale.float()).clamp(-top, top)
            want = want.to(cache_dtype) if cache_dtype.is_floating_point else want.round().to(cache_dtype)
            assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_per_head_kv_scales_scale_each_heads_codes(tmp_path, cache_dtype):
    """compressed-tensors' attn_head strategy: k_scale / v_scale [kv_heads, 1, 1], one per kv head."""
    path = str(tmp_path / "kv")
    write_fp8(path, qwen3(), "block")
    k, v = torch.tensor([0.011, 0.023]).view(2, 1, 1), torch.tensor([0.031, 0.004]).view(2, 1, 1)
    _rewrite(path, lambda s: s.update({"model.layers.1.self_attn.k_scale": k, "model.layers.1.self_attn.v_scale": v}))
    model = LoadedModel(path, dtype="float32", quantization=None).model
    assert model.model.layers[0].self_attn.attn.kv_scales is None
    assert model.model.layers[1].self_attn.attn.kv_scales == (tuple(k.flatten().tolist()), tuple(v.flatten().tolist()))
    cache, kv = prefill_cache(model, cache_dtype)
    top = torch.finfo(cache_dtype).max if cache_dtype.is_floating_point else 127
    k_codes, v_codes, k_scales, v_scales = written(cache, 1)
    for codes, stored, x, checkpoint_scales in ((k_codes, k_scales, kv[1][0], k), (v_codes, v_scales, kv[1][1], v)):
        for head, checkpoint_scale in enumerate(checkpoint_scales.flatten().tolist()):
            scale = torch.tensor(checkpoint_scale * 448 / top).bfloat16()
            assert (stored[:, head] == scale).all()
            want = (x[:, head] / scale.float()).clamp(-top, top)
            want = want.to(cache_dtype) if cache_dtype.is_floating_point else want.round().to(cache_dtype)
            assert torch.equal(codes[:, head].view(torch.uint8), want.view(torch.uint8))


def test_a_rank_keeps_its_own_heads_kv_scales():
    """Under tensor parallelism a rank's cache holds its kv heads only: it takes their scales, and a kv head
    replicated over ranks (fewer kv heads than ranks) gives each of them its one scale."""
    from qwenserve.model.layers.attention import Attention
    scales = torch.tensor([0.01, 0.02, 0.03, 0.04]).view(4, 1, 1)
    second_rank = Attention(0, num_heads=4, num_kv_heads=2, head_dim=8, scale=1.0, kv_heads=(4, 2))
    second_rank.load_kv_scale("kv", scales)
    assert second_rank.kv_scales == ((scales[2].item(), scales[3].item()),) * 2
    replicated = Attention(0, num_heads=1, num_kv_heads=1, head_dim=8, scale=1.0, kv_heads=(4, 3))
    replicated.load_kv_scale("v", scales)
    assert replicated.kv_scales == (None, (scales[3].item(),))


def test_compressed_tensors_kv_scales_are_the_projections_output_scales(tmp_path):
    path = str(tmp_path / "ct")
    write_fp8(path, qwen2(), "ct-channel")
    k, v = torch.tensor([0.013]), torch.tensor([0.006])  # [1], as compressed-tensors' kv_cache_scheme writes them
    _rewrite(path, lambda s: s.update({"model.layers.1.self_attn.k_proj.output_scale": k,
                                       "model.layers.1.self_attn.v_proj.output_scale": v}))
    model = LoadedModel(path, dtype="float32", quantization=None).model
    assert model.model.layers[0].self_attn.attn.kv_scales is None
    assert model.model.layers[1].self_attn.attn.kv_scales == (k.item(), v.item())
    _, _, k_scales, v_scales = written(prefill_cache(model, torch.float8_e4m3fn)[0], 1)
    assert (k_scales == k.bfloat16()).all() and (v_scales == v.bfloat16()).all()


def test_without_kv_scales_the_cache_scales_each_token(tmp_path):
    path = str(tmp_path / "block")
    write_fp8(path, qwen3(), "block")
    model = LoadedModel(path, dtype="float32", quantization=None).model
    assert model.model.layers[0].self_attn.attn.kv_scales is None
    cache, kv = prefill_cache(model, torch.float8_e4m3fn)
    k_codes, _, k_scales, _ = written(cache, 0)
    torch.testing.assert_close(k_scales, (kv[0][0].abs().amax(-1) / 448).bfloat16(), atol=0, rtol=0)
    assert k_scales.unique().numel() > 10


def test_kv_cache_dtype_fp8_generates_with_and_without_checkpoint_scales(tmp_path):
    ref = write_fp8(tmp_path / "plain", qwen3(), "block")
    # scales well above the keys' range: the tokens stay the reference's (fp8's rounding aside)
    for name, scale in (("scaled", torch.tensor(0.05)), ("per_head", torch.tensor([0.05, 0.07]).view(2, 1, 1))):
        write_fp8(tmp_path / name, qwen3(), "block")
        _rewrite(str(tmp_path / name), lambda s: s.update({f"model.layers.{i}.self_attn.kv_scale": scale.clone()
                                                           for i in range(2)}))
    prompts = [list(range(3 + i, 14 + 3 * i)) for i in range(2)]
    for name in ("plain", "scaled", "per_head"):
        llm = LLM(str(tmp_path / name), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="8MiB")
        outputs = greedy_tokens(llm, prompts)
        assert all(len(out) == 10 for out in outputs)
        with torch.no_grad():  # each token within fp8's error of the reference's best
            for prompt, out in zip(prompts, outputs):
                logits = ref(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
                chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
                assert (chosen >= logits.max(-1).values - 0.05 * logits.abs().max()).all()


def test_bad_kv_scale_is_refused(tmp_path):
    path = str(tmp_path / "kv")
    write_fp8(path, qwen3(), "block")
    _rewrite(path, lambda s: s.__setitem__("model.layers.0.self_attn.k_scale", torch.ones(3)))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.self_attn\.k_scale: a KV cache scale must be "
                                              r"floating-point, one value \(per tensor\) or one per kv head \(2\), "
                                              r"got torch.float32 \(3,\)"):
        LoadedModel(path, dtype="float32", quantization=None)
    _rewrite(path, lambda s: s.__setitem__("model.layers.0.self_attn.k_scale", torch.tensor([0.01, 0.0])))
    with pytest.raises(WeightLoadError, match=r"k_scale: KV cache scale 0.0 must be positive and finite"):
        LoadedModel(path, dtype="float32", quantization=None)

"""Decode steps of a block-quantized model run all its decoder layers in one call of the compiled kernels
(model/layers/decode_layers.py), which calls the kernels the layer modules call, in their order. Checked against
enforce_eager (the modules one by one) on a tiny random GGUF model and its FP8 form: the same tokens and the same
log-probabilities to the bit, in bf16 and float32, with sequences of different lengths decoding side by side; the
call is taken for decode steps, never for prefill or under a LoRA adapter, and not where some part of a layer has no
kernel."""
import peft
import pytest
import torch
from helpers import fused_steps, save_gguf, save_hf_dir, tiny_hf_model  # noqa: F401 (fixture fused_steps)

from qwenserve import LLM, LoRARequest, SamplingParams

PROMPTS = ["abc", "hello there, this prompt is longer than the others", "x = [1, 2, 3]\nprint(x)"]


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(seed=7, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)


@pytest.fixture(scope="module")
def gguf_path(hf_model, tmp_path_factory):
    # llama.cpp's Q4_K_M mix for 32-weight types: more bits for v and down
    return save_gguf(hf_model, str(tmp_path_factory.mktemp("d") / "tiny.gguf"), "Q5_0",
                     {"v_proj": "Q8_0", "down_proj": "Q8_0", "lm_head": "Q8_0"})


def generate(path, dtype, enforce_eager, lora_request=None, **engine):
    llm = LLM(model=path, dtype=dtype, enforce_eager=enforce_eager, max_model_len=256, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora_request)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_call_equals_the_layer_modules_bit_for_bit(ops, gguf_path, fused_steps, dtype):
    fused = generate(gguf_path, dtype, enforce_eager=False)
    assert max(fused_steps) == len(PROMPTS), "the batched decode steps did not take the one-call path"
    assert 0 in fused_steps, "the prefill step must run the modules"
    fused_steps.clear()
    eager = generate(gguf_path, dtype, enforce_eager=True)
    assert not any(fused_steps), "enforce_eager must run the modules at every step"
    assert fused == eager


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_projections_take_the_one_call_bit_for_bit(ops, hf_model, fused_steps, tmp_path, dtype):
    """FP8 weights (quantized at load, as an FP8 checkpoint holds them) run in the one call through fp8_mm, with the
    modules' answers to the bit."""
    path = save_hf_dir(hf_model, str(tmp_path / "hf"))
    fused = generate(path, dtype, enforce_eager=False, quantization="fp8")
    assert max(fused_steps) == len(PROMPTS), "FP8 decode steps did not take the one-call path"
    fused_steps.clear()
    assert fused == generate(path, dtype, enforce_eager=True, quantization="fp8")
    assert not any(fused_steps)


def test_parts_without_a_kernel_run_the_modules(ops, gguf_path, fused_steps):
    """An int8 KV cache (codes and scales written by Python) and dense weights keep the modules, with the same
    answers as enforce_eager."""
    for engine in ({"kv_cache_dtype": "int8"}, {"quantization": "none"}):
        taken = generate(gguf_path, "bfloat16", enforce_eager=False, **engine)
        assert not any(fused_steps), engine
        assert taken == generate(gguf_path, "bfloat16", enforce_eager=True, **engine)


def test_steps_with_an_adapter_run_the_modules(ops, hf_model, gguf_path, fused_steps, tmp_path):
    """With LoRA enabled, decode steps of base-model requests alone still take the one call; a step with an
    adapter's request runs the modules (the call knows nothing of adapters); the answers equal enforce_eager's."""
    import copy
    torch.manual_seed(3)
    adapter = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    adapter.save_pretrained(str(tmp_path))
    lora = LoRARequest("a", 1, str(tmp_path))
    engine = dict(enable_lora=True, max_lora_rank=4)
    base_only = generate(gguf_path, "float32", enforce_eager=False, **engine)
    assert max(fused_steps) == len(PROMPTS)
    fused_steps.clear()
    mixed = generate(gguf_path, "float32", enforce_eager=False, lora_request=[lora, None, None], **engine)
    assert not any(fused_steps)
    assert mixed[1:] == base_only[1:] and mixed[0] != base_only[0]
    assert mixed == generate(gguf_path, "float32", enforce_eager=True, lora_request=[lora, None, None], **engine)


def _add_undeclared_part(llm) -> None:
    """Give every decoder layer a part its decode_parts do not name: a parameter that scales the layer's output."""
    model = llm.engine.executor.worker.model.model
    for layer in model.own_layers:
        layer.output_scale = torch.nn.Parameter(torch.full((layer.input_layernorm.weight.shape[0],), 0.75),
                                                requires_grad=False)
        run_layer = layer.forward

        def scaled(*args, _run=run_layer, _layer=layer):
            hidden, residual = _run(*args)
            return hidden * _layer.output_scale, residual
        layer.forward = scaled
    model.fused_decode.routes_changed()


def test_a_part_the_call_does_not_run_keeps_the_modules(ops, gguf_path, fused_steps):
    """A layer holding a parameter outside the parts the one call runs is never fused (the call would skip it):
    its decode steps run the modules, whose answers (changed by the part) equal enforce_eager's."""
    plain = generate(gguf_path, "float32", enforce_eager=False)
    fused_steps.clear()
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    answers = []
    for eager in (False, True):
        llm = LLM(model=gguf_path, dtype="float32", enforce_eager=eager, max_model_len=256)
        _add_undeclared_part(llm)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        answers.append([(list(o.outputs[0].token_ids),
                         [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                        for o in outs])
    assert fused_steps and not any(fused_steps)
    assert answers[0] == answers[1] and answers[0] != plain

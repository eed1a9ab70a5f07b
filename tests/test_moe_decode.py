"""Decode steps of a mixture-of-experts GGUF model run all its decoder layers in one call of the compiled kernels
(model/layers/decode_layers.py), MoE layers included: the router by the module's own ATen ops, the experts by
ggml_moe on their blocks, Qwen2-MoE's shared expert by its ggml_mm segments and its sigmoid gate. Checked against
enforce_eager (the modules one by one) on tiny random Qwen2-MoE (shared expert) and Qwen3-MoE files written as
llama.cpp writes them (helpers.save_gguf): the same greedy tokens and the same logits to the bit, batched and one
sequence alone, in bf16 and float32; every layer is one the call runs, and the batched decode steps take it. A file
whose experts are float (dense experts, run in PyTorch) keeps the modules."""
import pytest
import torch
from helpers import PROMPTS, fused_steps, save_gguf  # noqa: F401 (fixture fused_steps)
from test_moe import tiny_moe

from qwenserve import LLM, SamplingParams
from qwenserve.model.layers.decode_layers import runs_every_part

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
BATCH = PROMPTS[:3]

CASES = {
    # a shared expert (and its sigmoid gate) in every layer, top-k not renormalised
    "qwen2_moe": ("qwen2_moe", {}),
    # no shared expert, renormalised, the middle layer a dense MLP between two sparse ones
    "qwen2_moe-noshared-dense1": ("qwen2_moe", dict(shared_expert_intermediate_size=0, norm_topk_prob=True,
                                                    mlp_only_layers=[1])),
    # Qwen3's per-head q/k norms, every layer sparse, renormalised
    "qwen3_moe": ("qwen3_moe", dict(norm_topk_prob=True)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def moe_gguf(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    hf = tiny_moe(kind, seed=len(request.param), **overrides)
    return request.param, save_gguf(hf, str(tmp_path_factory.mktemp(request.param) / "moe.gguf"), quant="Q8_0")


def answers(llm, prompts):
    """Per prompt: the greedy tokens and every step's logits."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [torch.as_tensor(step) for step in o.outputs[0].logits]) for o in outs]


def assert_same(got, expected, where):
    assert len(got) == len(expected), where
    for i, ((tokens, logits), (want_tokens, want_logits)) in enumerate(zip(got, expected)):
        assert tokens == want_tokens, (where, i)
        assert len(logits) == len(want_logits) == GREEDY.max_tokens, (where, i)
        for step, (a, b) in enumerate(zip(logits, want_logits)):
            assert a.dtype == b.dtype and torch.equal(a, b), (where, i, step)


def run(path, dtype, enforce_eager):
    llm = LLM(path, dtype=dtype, kv_cache_memory="32MiB", quantization="gguf", enforce_eager=enforce_eager,
              record_logits=True)
    return llm, answers(llm, BATCH), [answers(llm, [p])[0] for p in BATCH]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_moe_layers_in_one_call_equal_the_modules_bit_for_bit(ops, moe_gguf, fused_steps, dtype):
    name, path = moe_gguf
    llm, batched, alone = run(path, dtype, enforce_eager=False)
    model = llm.engine.executor.worker.model.model
    layers = model.own_layers
    assert any(type(layer.mlp).__name__ == "SparseMoeBlock" for layer in layers)
    for layer in layers:
        assert runs_every_part(layer), (name, layer.decode_parts)
        if type(layer.mlp).__name__ == "SparseMoeBlock":
            assert layer.mlp.experts.blocks is not None
            assert ("mlp.shared_expert_gate" in layer.decode_parts) == (layer.mlp.shared_expert is not None)
    assert model.fused_decode._rows_below() > len(BATCH)
    assert model.fused_decode._call.num_layers() == len(layers)
    assert max(fused_steps) == len(BATCH), "the batched decode steps did not take the one-call path"
    assert fused_steps.count(1) >= len(BATCH) * (GREEDY.max_tokens - 1), "single sequences' decode steps did not"
    assert 0 in fused_steps, "the prefill steps must run the modules"
    fused_steps.clear()
    _, eager_batched, eager_alone = run(path, dtype, enforce_eager=True)
    assert not any(fused_steps), "enforce_eager must run the modules at every step"
    assert_same(batched, eager_batched, (name, dtype, "batched"))
    assert_same(alone, eager_alone, (name, dtype, "alone"))


def test_float_experts_keep_the_modules(ops, fused_steps, tmp_path):
    """Experts the file holds in float run dense in PyTorch, which the call does not run: with every projection
    of the layers still blocks, the decode steps run the modules, with enforce_eager's answers."""
    hf = tiny_moe("qwen3_moe", seed=2, norm_topk_prob=True)
    path = save_gguf(hf, str(tmp_path / "float-experts.gguf"), quant="Q8_0", overrides={"experts": "F32"})
    llm, batched, _ = run(path, "float32", enforce_eager=False)
    model = llm.engine.executor.worker.model.model
    assert all(layer.mlp.experts.blocks is None and layer.mlp.experts.w13 is not None for layer in model.own_layers)
    assert fused_steps and not any(fused_steps)
    assert model.fused_decode._rows_below() == 0
    _, eager_batched, _ = run(path, "float32", enforce_eager=True)
    assert_same(batched, eager_batched, "float experts")

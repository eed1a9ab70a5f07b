"""Qwen3 (dense) against HF transformers' own Qwen3ForCausalLM in float32: tiny random checkpoints made with
transformers' Qwen3Config, tied and untied, with a head_dim other than hidden / heads (as the published 0.6B has);
greedy tokens batched and one by one, with our CPU kernels and without; the same weights as a qwen3 GGUF; the
fused decode call, which runs the q/k norms and gives the layer modules' results to the bit; and what Qwen2 runs
besides: int8 / int4 weights, int8 / fp8 KV caches, pipeline and data parallel, prefix caching, yarn."""
import dataclasses
import json

import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import KV_CACHE_DTYPES, ModelConfig
from qwenserve.model.layers.decode_layers import FusedDecodeLayers, runs_every_part
from qwenserve.model.loader.model_loader import LoadedModel
from qwenserve.worker.model_runner import full_logits

from helpers import (
    PROMPTS,
    assert_hf_greedy,
    dense_route_from,
    draft_keeps_greedy,
    greedy_tokens,
    save_gguf,
    save_hf_dir,
    tiny_qwen3,
)
from test_engine import GREEDY as ENGINE_GREEDY, assert_no_leak, prompts, run

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3(request, tmp_path_factory):
    hf = tiny_qwen3(seed=11, tie_word_embeddings=request.param)
    return hf, save_hf_dir(hf, str(tmp_path_factory.mktemp("qwen3")))


def test_config_reads_head_dim_and_bias(qwen3):
    hf, _ = qwen3
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    assert (config.head_dim, config.attention_bias, config.architectures) == (32, False, ("Qwen3ForCausalLM",))
    assert config.hidden_size // config.num_attention_heads == 16
    with pytest.raises(ConfigError, match="head_dim must be a positive even integer"):
        dataclasses.replace(config, head_dim=31)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_greedy_equals_hf_batched_and_alone(qwen3, cpu_kernels):
    hf, path = qwen3
    llm = LLM(path, dtype="float32", cpu_kernels=cpu_kernels, kv_cache_memory="32MiB")
    batched = greedy_tokens(llm, params=GREEDY)
    assert_hf_greedy(hf, PROMPTS, batched)
    assert [greedy_tokens(llm, [p], GREEDY)[0] for p in PROMPTS] == batched
    hf_logits = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    expected = torch.log_softmax(hf_logits.double(), -1)
    for token, logprob in out.logprobs[0].items():
        assert abs(logprob.logprob - float(expected[token].detach())) < 1e-4


def test_attention_bias_when_config_asks(tmp_path):
    hf = tiny_qwen3(seed=12, attention_bias=True)
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    llm = LLM(save_hf_dir(hf, str(tmp_path / "biased")), dtype="float32", kv_cache_memory="32MiB")
    assert_hf_greedy(hf, PROMPTS, greedy_tokens(llm, params=GREEDY))


@pytest.fixture(scope="module")
def qwen3_gguf(qwen3, tmp_path_factory):
    hf, _ = qwen3
    return save_gguf(hf, str(tmp_path_factory.mktemp("qwen3gguf") / "tiny-qwen3.gguf"), "F32")


def test_gguf_gives_the_hf_tokens(qwen3, qwen3_gguf):
    hf, _ = qwen3
    llm = LLM(qwen3_gguf, dtype="float32", kv_cache_memory="32MiB")
    config = llm.engine.resolved_model.config
    assert (config.head_dim, config.attention_bias, config.architectures[0]) == (32, False, "Qwen3ForCausalLM")
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert_hf_greedy(hf, PROMPTS, greedy_tokens(llm, params=GREEDY))


def test_block_quantized_decode_in_one_call_equals_the_modules(ops, qwen3, tmp_path, monkeypatch):
    """The fused decode call runs Qwen3's q/k norms (declared in its layer's decode_parts): its decode steps take the
    one call, with enforce_eager's tokens and log-probabilities to the bit."""
    hf, _ = qwen3
    path = save_gguf(hf, str(tmp_path / "q8.gguf"), "Q8_0")
    fused = []
    original = FusedDecodeLayers.call_for

    def counting(self, attn_metadata, rows):
        call = original(self, attn_metadata, rows)
        fused.append(call is not None)
        return call
    monkeypatch.setattr(FusedDecodeLayers, "call_for", counting)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    answers = []
    for eager in (False, True):
        llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        answers.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()}
                                                   for step in o.outputs[0].logprobs]) for o in outs])
        if not eager:
            layer = llm.engine.executor.worker.model.model.own_layers[0]
            assert runs_every_part(layer) and "self_attn.q_norm" in layer.decode_parts
            assert any(fused), "Qwen3's decode steps did not take the one call"
            fused.clear()
    assert not any(fused)
    assert answers[0] == answers[1]


def test_lora_adapter_equals_peft(qwen3, tmp_path):
    """A PEFT adapter on every projection (q/k/v of head width 32, o_proj from 128 inputs) gives PEFT's tokens and
    logits."""
    import copy

    import peft

    from qwenserve import LoRARequest
    hf, path = qwen3
    torch.manual_seed(5)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    adapter = peft.get_peft_model(copy.deepcopy(hf), config).eval()
    adapter.save_pretrained(str(tmp_path / "adapter"))
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_lora_rank=4,
              record_logits=True)
    ids = PROMPTS[2]
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))[0].outputs[0]
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            step = adapter(input_ids=torch.tensor([ids + tokens])).logits[0, -1]
            logits.append(step)
            tokens.append(int(step.argmax()))
    assert list(out.token_ids) == tokens
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(logits), atol=1e-4, rtol=0)


def test_speculative_decoding_with_itself_as_draft_accepts_every_token(qwen3):
    """A Qwen3 draft for a Qwen3 target (here the target itself): greedy output unchanged, every proposal accepted,
    which holds only if the draft's KV cache of q/k-normed, head_dim-wide heads is right."""
    _, path = qwen3
    stats = draft_keeps_greedy(path, path, max_tokens=24)
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]


# ---- what else Qwen2 runs: int8 / int4 weights, quantized KV caches, pipeline and data parallel, prefix caching,
# yarn rope scaling ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3_wide(request, tmp_path_factory):
    """Every projection's inputs a multiple of int4's group of 128 (hidden 128, o_proj 4 x 128), with the published
    sizes' head_dim of 128 against hidden / heads of 32."""
    hf = tiny_qwen3(seed=13, tie_word_embeddings=request.param, hidden_size=128, intermediate_size=256, head_dim=128)
    return hf, save_hf_dir(hf, str(tmp_path_factory.mktemp("qwen3wide")))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int_quantization_rounds_the_projections_and_keeps_the_qk_norms_float(ops, qwen3_wide, method):
    """The projections become blocks, the q/k norms stay float32 parameters equal to HF's; the logits are those
    of the dense model on the rounded weights (as Qwen2's), and the engine's greedy tokens too."""
    hf, path = qwen3_wide
    quantized = LLM(path, dtype="float32", quantization=method, kv_cache_memory="8MiB")
    rounded = LLM(path, dtype="float32", kv_cache_memory="8MiB")
    model, dense = (llm.engine.executor.worker.model for llm in (quantized, rounded))
    blocks = {name: m.segments[0][1] for name, m in model.named_modules() if getattr(m, "segments", None)}
    assert {n.split(".", 3)[-1] for n in blocks if n.startswith("model.layers.")} == \
        {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}
    for i, layer in enumerate(model.model.layers):
        for norm in ("q_norm", "k_norm"):
            weight = getattr(layer.self_attn, norm).weight
            assert weight.dtype == torch.float32 and not hasattr(getattr(layer.self_attn, norm), "segments")
            assert torch.equal(weight, getattr(hf.model.layers[i].self_attn, norm).weight)
    params = dict(dense.named_parameters())
    with torch.no_grad():
        for name, tensor in blocks.items():
            params[f"{name}.weight"].copy_(tensor.dequantize())
    many = list(range(3, 3 + dense_route_from(model) + 6))  # prefill-sized: the blocks run dense
    torch.testing.assert_close(full_logits(model, many), full_logits(dense, many), atol=1e-4, rtol=1e-4)
    few = list(range(9, 41))  # decode-sized: int8 dot products on activations quantized per block of 32
    got, want = full_logits(model, few), full_logits(dense, few)
    assert (got - want).norm() < 0.05 * want.norm()
    assert greedy_tokens(quantized, params=GREEDY) == greedy_tokens(rounded, params=GREEDY)


@pytest.mark.parametrize("kv_cache_dtype,tol", [("int8", 0.1), ("fp8_e4m3", 0.25)])
def test_quantized_kv_cache_keeps_the_float_caches_choices(ops, qwen3_wide, kv_cache_dtype, tol):
    """Heads of 128 in an int8 / fp8 cache. Each greedy token, given the tokens before it, is the float model's
    best within tol, and its log-probability the float model's within tol (Qwen2's gap, measured at every step:
    a tiny random model's near-ties make the share of equal tokens a matter of its seed)."""
    _, path = qwen3_wide
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.executor.worker.kv_cache.k[0].shape[-1] == 128
    assert llm.engine.executor.worker.kv_cache.k[0].dtype == getattr(torch, KV_CACHE_DTYPES[kv_cache_dtype])
    float_model = LoadedModel(path, dtype="float32").model
    ps = prompts([5, 40, 90, 17], seed=5)
    for prompt, out in zip(ps, run(llm, ps, max_tokens=30, logprobs=1, **ENGINE_GREEDY)):
        out = out.outputs[0]
        assert len(out.token_ids) == 30
        expected = torch.log_softmax(full_logits(float_model, prompt + list(out.token_ids[:-1]))[len(prompt) - 1:]
                                     .double(), -1)
        for step, token in enumerate(out.token_ids):
            assert float(expected[step].max() - expected[step, token]) < tol, (prompt, step)
            assert abs(out.logprobs[step][token].logprob - float(expected[step, token])) < tol, (prompt, step)
    assert_no_leak(llm)


@pytest.mark.multiproc
def test_pipeline_parallel_gives_one_stages_tokens(qwen3):
    """Two stages of one layer each; a tied head on the last stage loads its own copy of the embedding."""
    hf, path = qwen3
    expected = greedy_tokens(LLM(path, dtype="float32", kv_cache_memory="32MiB"), params=GREEDY)
    assert_hf_greedy(hf, PROMPTS, expected)
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", pipeline_parallel_size=2)
    try:
        assert llm.engine.executor.max_concurrent_batches == 2
        assert greedy_tokens(llm, params=GREEDY) == expected
    finally:
        llm.engine.shutdown()


@pytest.mark.multiproc
def test_data_parallel_gives_one_replicas_tokens(qwen3):
    _, path = qwen3
    expected = greedy_tokens(LLM(path, dtype="float32", kv_cache_memory="32MiB"), params=GREEDY)
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", data_parallel_size=2)
    try:
        assert len(llm.engine.replicas) == 2
        assert greedy_tokens(llm, params=GREEDY) == expected
    finally:
        llm.engine.shutdown()


def test_prefix_caching_reuses_the_blocks_without_changing_the_tokens(qwen3):
    """A second request on the same 40-token prefix finds its two whole blocks of 16 in the cache and decodes what
    an engine without the cache decodes."""
    _, path = qwen3
    shared = prompts([40], vocab=320, seed=3)[0]
    ps = [shared + tail for tail in prompts([7, 3], vocab=320, seed=4)]
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB")
    first, second = (run(llm, [p], max_tokens=10, **ENGINE_GREEDY)[0] for p in ps)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    plain = run(LLM(path, dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False), ps, max_tokens=10,
                **ENGINE_GREEDY)
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [o.outputs[0].token_ids for o in plain]
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert_no_leak(llm)


def test_yarn_rope_scaling_equals_hf(tmp_path):
    """yarn (factor 4 over 32 original positions), written either way config.json has it: the logits over 40
    positions equal HF's, and so do the greedy tokens decoded from position 24 to 48."""
    hf = tiny_qwen3(seed=14, max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})
    path = save_hf_dir(hf, str(tmp_path / "yarn"))
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB")
    assert llm.engine.resolved_model.config.rope_scaling["rope_type"] == "yarn"
    ids = prompts([40], vocab=320, seed=1)[0]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(llm.engine.executor.worker.model, ids), expected, atol=2e-5, rtol=1e-4)
    assert_hf_greedy(hf, [ids[:24]], greedy_tokens(llm, [ids[:24]], SamplingParams(temperature=0, max_tokens=24,
                                                                                      ignore_eos=True)))
    # the form Qwen3's model card has users add to config.json (transformers 4: rope_theta and rope_scaling)
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    legacy = LLM(path, dtype="float32", kv_cache_memory="8MiB").engine.executor.worker.model
    torch.testing.assert_close(full_logits(legacy, ids), expected, atol=2e-5, rtol=1e-4)

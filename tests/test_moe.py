"""Mixture-of-experts models against HF transformers in float32: tiny random Qwen2-MoE and Qwen3-MoE checkpoints
written with transformers' own Qwen2MoeConfig and Qwen3MoeConfig (shared expert on and off, norm_topk_prob both
ways, dense layers between sparse ones by mlp_only_layers and decoder_sparse_step); greedy tokens batched and one
by one, logits within float32 rounding; the experts' grouping against a plain per-token reference; tensor
parallelism at 2 against one process; config fields checked with errors that name them. The same checkpoints as
llama.cpp GGUF files (qwen2moe, qwen3moe; helpers.save_gguf): F32 gives HF's greedy tokens, Q8_0 with the linear
layers' blocks kept equals the same file dequantized at load."""
import dataclasses

import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import ModelConfig
from qwenserve.model.layers.moe import FusedExperts, TopKRouter
from qwenserve.model.models.qwen2_moe import MoEConfig

from helpers import (PROMPTS, assert_hf_greedy, greedy_tokens, randomize, save_gguf, save_hf_dir,
                     tensor_parallel_logits, tiny_vocab)

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def tiny_moe(kind: str, seed: int = 0, **overrides):
    """A random Qwen2MoeForCausalLM or Qwen3MoeForCausalLM (float32) of 3 layers and 6 experts, 2 per token."""
    import transformers
    tokens = tiny_vocab(320)[0]
    kw = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              eos_token_id=tokens.index("<|im_end|>"), bos_token_id=tokens.index("<|endoftext|>"))
    if kind == "qwen2_moe":
        kw |= dict(shared_expert_intermediate_size=64)  # rows of whole Q8_0 blocks
        config_class, model_class = transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM
    else:
        kw |= dict(head_dim=32)
        config_class, model_class = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    kw.update(overrides)
    torch.manual_seed(seed)
    # spread router logits: the top-k is not a near tie
    return randomize(model_class(config_class(**kw)).eval(), norm_spread=0.2, std_by_suffix={"mlp.gate.weight": 0.5})


CASES = {
    # shared expert, unnormalised top-k (Qwen2-MoE's default), every layer sparse
    "qwen2_moe": ("qwen2_moe", {}),
    # no shared expert, top-k renormalised, the middle layer dense
    "qwen2_moe-noshared-norm-dense1": ("qwen2_moe", dict(shared_expert_intermediate_size=0, norm_topk_prob=True,
                                                         mlp_only_layers=[1])),
    # renormalised, as the published Qwen3-MoE config.json files say (transformers' Qwen3MoeConfig defaults to
    # false) and as llama.cpp runs every qwen3moe GGUF; every other layer sparse: layers 1 (of 0-2) only
    "qwen3_moe-step2": ("qwen3_moe", dict(decoder_sparse_step=2, norm_topk_prob=True)),
    "qwen3_moe-unnormalised": ("qwen3_moe", dict(norm_topk_prob=False)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def moe(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    hf = tiny_moe(kind, seed=len(request.param), **overrides)
    return hf, save_hf_dir(hf, str(tmp_path_factory.mktemp(request.param)))


def test_greedy_equals_hf_batched_and_alone(moe):
    hf, path = moe
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", record_logits=True)
    batched = greedy_tokens(llm, params=GREEDY)
    assert_hf_greedy(hf, PROMPTS, batched)
    assert [greedy_tokens(llm, [p], GREEDY)[0] for p in PROMPTS] == batched
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPTS[1]])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], expected, atol=1e-4, rtol=0)
    sparse = [type(layer.mlp).__name__ for layer in llm.engine.executor.worker.model.model.own_layers]
    hf_sparse = ["Sparse" in type(layer.mlp).__name__ for layer in hf.model.layers]
    assert [name == "SparseMoeBlock" for name in sparse] == hf_sparse


def test_experts_group_tokens_as_a_per_token_loop():
    """Uneven loads, an expert with no tokens, one token, every token on one expert, ties in the router."""
    from qwenserve.distributed.tensor_parallel import TensorParallel
    torch.manual_seed(0)
    experts = FusedExperts(5, 16, 8, TensorParallel())
    experts.w13.normal_(0, 0.3)
    experts.w2.normal_(0, 0.3)
    x = torch.randn(7, 16)
    loads = {"uneven": torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0], [0, 1], [1, 0], [2, 0]]),
             "one expert": torch.tensor([[4, 4]] * 7), "one token": torch.tensor([[2, 3]])}
    for name, ids in loads.items():
        rows = x[:len(ids)]
        weights = torch.rand(ids.shape)
        expected = torch.zeros_like(rows)
        for t in range(len(ids)):
            for slot in range(ids.shape[1]):
                gate, up = (experts.w13[ids[t, slot]] @ rows[t]).chunk(2)
                expected[t] += weights[t, slot] * (experts.w2[ids[t, slot]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(experts(rows, weights, ids), expected, atol=1e-5, rtol=1e-5, msg=name)
    router = TopKRouter(16, 5, 2, renormalize=True)
    router.weight.zero_()  # every expert ties: the top-k still picks k distinct experts, weights 1/k each
    weights, ids = router(x)
    assert (ids[:, 0] != ids[:, 1]).all() and torch.allclose(weights, torch.full_like(weights, 0.5))


def test_config_fields_are_checked(moe):
    hf, _ = moe
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    shared = config.architectures[0] == "Qwen2MoeForCausalLM"
    for extra, message in [({"num_experts_per_tok": 9}, "num_experts_per_tok \\(9\\) is more than num_experts"),
                           ({"moe_intermediate_size": 0}, "moe_intermediate_size must be a positive integer"),
                           ({"mlp_only_layers": [3]}, "mlp_only_layers holds \\[3\\]"),
                           ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
                           ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer")]:
        bad = dataclasses.replace(config, extra={**config.extra, **extra})
        with pytest.raises(ConfigError, match=message):
            MoEConfig.from_config(bad, False, shared)
    no_experts = {k: v for k, v in config.extra.items() if k not in ("num_experts", "num_local_experts")}
    with pytest.raises(ConfigError, match="lacks field\\(s\\) num_experts"):
        MoEConfig.from_config(dataclasses.replace(config, extra=no_experts), False, shared)


@pytest.mark.multiproc
def test_tensor_parallel_splits_every_expert(moe):
    from qwenserve.model.loader.model_loader import LoadedModel
    from qwenserve.worker.model_runner import full_logits
    _, path = moe
    expected = full_logits(LoadedModel(path, dtype="float32").model, PROMPTS[3])
    results = tensor_parallel_logits(path, 2, PROMPTS[3])
    for rank in range(2):
        torch.testing.assert_close(torch.from_numpy(results[rank]), expected, atol=1e-5, rtol=1e-5)


def _sparse_layers(model) -> list[bool]:
    return [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in model.model.own_layers]


def test_gguf_f32_greedy_equals_hf(moe, tmp_path):
    """llama.cpp's layout: experts stacked per projection, the router unquantized, the shared expert's gate a
    vector; dense layers from the tensors present, norm_topk_prob from the family (or expert_weights_norm)."""
    hf, _ = moe
    path = save_gguf(hf, str(tmp_path / "moe-f32.gguf"), quant="F32")
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    assert_hf_greedy(hf, PROMPTS, greedy_tokens(llm, params=GREEDY))
    model = llm.engine.executor.worker.model
    assert _sparse_layers(model) == ["Sparse" in type(layer.mlp).__name__ for layer in hf.model.layers]
    moe_config = MoEConfig.from_config(model.config, False, True)
    assert moe_config.norm_topk_prob == hf.config.norm_topk_prob
    assert moe_config.shared_expert_intermediate_size == (getattr(hf.config, "shared_expert_intermediate_size", 0)
                                                          or 0)


def test_gguf_q8_0_blocks_equal_dequantized_at_load(moe, tmp_path):
    """Q8_0 experts and layers: the linear layers' blocks kept (experts dequantized at load either way) give the
    logits of the file dequantized at load, and the tokens; both near HF's (quantization noise only)."""
    from qwenserve.model.loader.model_loader import LoadedModel
    from qwenserve.worker.model_runner import full_logits
    hf, _ = moe
    path = save_gguf(hf, str(tmp_path / "moe-q8_0.gguf"), quant="Q8_0")
    dequantized = full_logits(LoadedModel(path, dtype="float32", quantization="none").model, PROMPTS[3])
    blocks = full_logits(LoadedModel(path, dtype="float32", quantization="gguf").model, PROMPTS[3])
    torch.testing.assert_close(blocks, dequantized, atol=2e-3, rtol=0)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPTS[3]])).logits[0]
    torch.testing.assert_close(dequantized, expected, atol=0.3, rtol=0)
    kept = greedy_tokens(LLM(path, dtype="float32", kv_cache_memory="32MiB", quantization="gguf"), params=GREEDY)
    assert kept == greedy_tokens(LLM(path, dtype="float32", kv_cache_memory="32MiB", quantization="none"),
                                 params=GREEDY)


def test_gguf_moe_metadata_is_checked(tmp_path):
    from qwenserve.model.loader.checkpoint import config_from_gguf
    from qwenserve.model.loader.gguf_file import GGUFFile
    hf = tiny_moe("qwen3_moe")
    file = GGUFFile(save_gguf(hf, str(tmp_path / "m.gguf"), quant="F32"))
    names = frozenset(file.tensors)
    assert config_from_gguf(file.metadata, names).extra["num_experts"] == 6
    with pytest.raises(ConfigError, match="qwen3moe.expert_count must be a positive integer"):
        config_from_gguf({k: v for k, v in file.metadata.items() if k != "qwen3moe.expert_count"}, names)
    with pytest.raises(ConfigError, match="no router tensor"):
        config_from_gguf(file.metadata, frozenset(n for n in names if "ffn_gate_inp" not in n))


def test_lora_on_attention_equals_peft_and_on_experts_is_refused(tmp_path):
    """Adapters of the attention projections run on a MoE model as on a dense one; an adapter of the experts' (or
    the shared expert's) projections fails its request with an error naming the tensor, and the engine goes on."""
    import copy

    import peft

    from qwenserve import LoRARequest
    from qwenserve.config.errors import RequestError
    hf = tiny_moe("qwen2_moe", seed=1)
    llm = LLM(save_hf_dir(hf, str(tmp_path / "base")), dtype="float32", enable_lora=True, max_lora_rank=4,
              kv_cache_memory="32MiB")

    def adapter(name, targets):
        torch.manual_seed(2)
        model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets)).eval()
        model.save_pretrained(str(tmp_path / name))
        return model, LoRARequest(name, len(name), str(tmp_path / name))

    attention, request = adapter("attn", ["q_proj", "v_proj", "o_proj"])
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=request)[0]
    tokens = []
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            tokens.append(int(attention(input_ids=torch.tensor([PROMPTS[0] + tokens])).logits[0, -1].argmax()))
    assert list(out.outputs[0].token_ids) == tokens
    _, experts = adapter("experts", ["gate_proj"])
    with pytest.raises(RequestError, match="mlp.shared_expert.gate_proj.lora_A.weight"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=experts)
    assert greedy_tokens(llm, [PROMPTS[1]], GREEDY)  # the engine serves on
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_speculative_decoding_and_structured_output_on_a_moe_model(tmp_path):
    """A dense Qwen3 draft for a Qwen3-MoE target keeps the target's greedy tokens; a JSON schema holds."""
    import json

    from helpers import draft_keeps_greedy, tiny_qwen3
    target = save_hf_dir(tiny_moe("qwen3_moe", seed=5, norm_topk_prob=True), str(tmp_path / "target"))
    draft = save_hf_dir(tiny_qwen3(seed=6, num_hidden_layers=1), str(tmp_path / "draft"))
    assert draft_keeps_greedy(target, draft, PROMPTS[:3])["spec_num_draft_tokens"] > 0
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    plain = LLM(target, dtype="float32", kv_cache_memory="32MiB")
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    constrained = SamplingParams(temperature=1.0, max_tokens=40, seed=3, structured_outputs={"json": json.dumps(schema)})
    for out in plain.generate(prompts, constrained, use_tqdm=False):
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"n"} and 0 <= value["n"] <= 99

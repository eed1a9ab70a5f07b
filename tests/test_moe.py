"""Mixture-of-experts models against HF transformers in float32: tiny random Qwen2-MoE and Qwen3-MoE checkpoints
written with transformers' own Qwen2MoeConfig and Qwen3MoeConfig (shared expert on and off, norm_topk_prob both
ways, dense layers between sparse ones by mlp_only_layers and decoder_sparse_step); greedy tokens batched and one
by one, logits within float32 rounding; the experts' grouping against a plain per-token reference; tensor
parallelism at 2 against one process; config fields checked with errors that name them. The same checkpoints as
llama.cpp GGUF files (qwen2moe, qwen3moe; helpers.save_gguf): F32 gives HF's greedy tokens, Q8_0 with the blocks
kept (the experts' too, as blocks only) equals the same file dequantized at load; tensor parallelism at 2 on the
blocks. Expert parallelism (enable_expert_parallel: whole experts per rank) at 2 against one process, dense and on
blocks, each rank holding only its experts, and its settings. The ggml_moe kernel (the experts on their blocks)
against the same quantization composed from ggml_mm and against the dense math on the dequantized experts, for
several block types, loads and dtypes."""
import dataclasses
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qwenserve import LLM, SamplingParams
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import ModelConfig
from qwenserve.model.layers.moe import FusedExperts, TopKRouter
from qwenserve.model.loader.ggml_tensor import DECODE_GROUP, GGMLTensor
from qwenserve.model.models.qwen2_moe import MoEConfig

from helpers import (PROMPTS, assert_hf_greedy, assert_seeded_samples_agree, fused_steps,  # noqa: F401
                     greedy_tokens, randomize, save_gguf, save_hf_dir, tensor_parallel_logits, tiny_vocab)

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


def test_sampled_first_tokens_follow_hf_probabilities(tmp_path):
    """Random sampling on a mixture-of-experts model draws at HF's probabilities: 600 first tokens of one prompt
    (n=200 samples a request, three seeds) at temperature 0.8 and top_k 4, their frequencies within 5 standard
    deviations of HF's float32 softmax over its top 4."""
    hf = tiny_moe("qwen3_moe", seed=21, norm_topk_prob=True)
    llm = LLM(save_hf_dir(hf, str(tmp_path / "hf")), dtype="float32", kv_cache_memory="32MiB", max_num_seqs=256)
    prompt = PROMPTS[2]
    draws = []
    for seed in (1, 2, 3):
        params = SamplingParams(n=200, temperature=0.8, top_k=4, max_tokens=1, seed=seed)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        draws += [c.token_ids[0] for c in out.outputs]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double() / 0.8
    top = torch.topk(logits, 4)
    probs = torch.softmax(top.values, -1)
    counts = torch.tensor([draws.count(int(t)) for t in top.indices], dtype=torch.double)
    assert counts.sum() == len(draws), "a token outside HF's top 4 was drawn"
    expected = probs * len(draws)
    sigma = (expected * (1 - probs)).sqrt()
    assert ((counts - expected).abs() < 5 * sigma).all(), (counts, expected)


def test_seeded_samples_on_blocks_are_the_modules_and_independent_of_the_batch(ops, tmp_path, fused_steps):
    """Seeded sampling (n=3, temperature, top_p) on a GGUF model whose experts are blocks: the one-call decode gives
    the modules' samples (enforce_eager), the samples of one request differ from each other, and a seeded request
    draws the same tokens alone and beside other requests."""
    path = save_gguf(tiny_moe("qwen2_moe", seed=22), str(tmp_path / "moe.gguf"), quant="Q8_0")
    seeded = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_tokens=12, seed=5, ignore_eos=True)
    noisy = SamplingParams(temperature=1.2, max_tokens=12, ignore_eos=True)

    def samples(eager, with_others):
        llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", enforce_eager=eager)
        requests = [{"prompt_token_ids": p} for p in (PROMPTS[4], PROMPTS[1], PROMPTS[5])]
        if not with_others:
            requests = requests[1:2]
        params = [noisy, seeded, noisy] if with_others else [seeded]
        outs = llm.generate(requests, params, use_tqdm=False)
        return [list(c.token_ids) for c in outs[1 if with_others else 0].outputs]
    assert_seeded_samples_agree(samples, fused_steps)


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
                           ({"mlp_only_layers": 1}, "mlp_only_layers must be a list of layer numbers, got 1"),
                           ({"mlp_only_layers": [True]}, "mlp_only_layers holds \\[True\\]"),
                           ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
                           ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer")]:
        bad = dataclasses.replace(config, extra={**config.extra, **extra})
        with pytest.raises(ConfigError, match=message):
            MoEConfig.from_config(bad, False, shared)
    no_experts = {k: v for k, v in config.extra.items() if k not in ("num_experts", "num_local_experts")}
    with pytest.raises(ConfigError, match="lacks field\\(s\\) num_experts"):
        MoEConfig.from_config(dataclasses.replace(config, extra=no_experts), False, shared)


@pytest.mark.parametrize("field, value, pattern", [
    # narrower than the checkpoint: the experts and the shared expert used to be cut to fit, without a word
    ("moe_intermediate_size", 24, r"experts\.0\.down_proj\.weight: expert down weight has shape \(64, 32\), the "
                                  r"model expects \(64, 24\)"),
    ("shared_expert_intermediate_size", 32, r"shared_expert\.down_proj\.weight: RowParallelLinear: checkpoint tensor "
                                            r"has shape \(64, 64\), the model expects \(64, 32\)"),
    # wider: torch's own narrowing error, naming no tensor
    ("moe_intermediate_size", 48, r"experts\.0\.down_proj\.weight: expert down weight has shape \(64, 32\), the "
                                  r"model expects \(64, 48\)"),
    ("shared_expert_intermediate_size", 96, r"shared_expert\.down_proj\.weight: RowParallelLinear: checkpoint tensor "
                                            r"has shape \(64, 64\), the model expects \(64, 96\)"),
    # none at all: only the empty shared expert transformers writes at width 0 may be dropped
    ("shared_expert_intermediate_size", 0, r"shared_expert\.down_proj\.weight: checkpoint tensor has shape "
                                           r"\(64, 64\), but config field shared_expert_intermediate_size is 0"),
], ids=["experts-narrower", "shared-narrower", "experts-wider", "shared-wider", "shared-none"])
def test_a_config_width_other_than_the_checkpoints_is_refused(tmp_path, field, value, pattern):
    """config.json's widths against a Qwen2-MoE checkpoint of experts 32 wide and a shared expert 64 wide: each
    tensor is checked whole, before a rank keeps its part, naming the tensor and both shapes."""
    from qwenserve.model.loader.model_loader import LoadedModel, WeightLoadError
    path = save_hf_dir(tiny_moe("qwen2_moe", seed=2), str(tmp_path / "m"))
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw[field] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(WeightLoadError, match=rf"{path}: model\.layers\.0\.mlp\.{pattern}"):
        LoadedModel(path, dtype="float32")


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_a_gguf_expert_width_other_than_the_files_is_refused(request, tmp_path, quantization):
    """A GGUF file whose expert_feed_forward_length (32) is narrower than its experts (64): refused whether the
    experts are dequantized or kept as blocks, whose rows and block-aligned columns used to be cut to fit."""
    from qwenserve.model.loader.model_loader import LoadedModel, WeightLoadError
    if quantization == "gguf":
        request.getfixturevalue("ops")
    hf = tiny_moe("qwen3_moe", seed=1, moe_intermediate_size=64)
    hf.config.moe_intermediate_size = 32  # what the file says; its experts stay 64 wide
    path = save_gguf(hf, str(tmp_path / "m.gguf"), quant="Q8_0")
    with pytest.raises(WeightLoadError, match=r"experts\.0\.gate_proj\.weight: expert gate weight has shape "
                                              r"\(64, 64\), the model expects \(32, 64\)"):
        LoadedModel(path, dtype="float32", quantization=quantization)


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


def _expert_layers(model) -> list:
    return [layer.mlp.experts for layer in model.model.own_layers if type(layer.mlp).__name__ == "SparseMoeBlock"]


def _assert_experts_are_blocks(model) -> None:
    """Every sparse layer's experts are uint8 blocks for ggml_moe; no float expert weight exists."""
    for experts in _expert_layers(model):
        blocks = experts.blocks
        assert blocks is not None and experts.w13 is None and experts.w2 is None
        assert all(t.dtype == torch.uint8 and t.dim() == 3 for t in (blocks.gate, blocks.down))
        assert all(p.numel() == 0 for p in experts.parameters())
        assert not any(b.is_floating_point() for b in experts.buffers())


def test_gguf_q8_0_blocks_equal_dequantized_at_load(moe, tmp_path):
    """Q8_0 experts and layers: the blocks kept (the linear layers' by ggml_mm, the experts' by ggml_moe) give the
    logits of the file dequantized at load, and the tokens; both near HF's (quantization noise only)."""
    from qwenserve.model.loader.model_loader import LoadedModel
    from qwenserve.worker.model_runner import full_logits
    hf, _ = moe
    path = save_gguf(hf, str(tmp_path / "moe-q8_0.gguf"), quant="Q8_0")
    dequantized = full_logits(LoadedModel(path, dtype="float32", quantization="none").model, PROMPTS[3])
    kept = LoadedModel(path, dtype="float32", quantization="gguf").model
    _assert_experts_are_blocks(kept)
    blocks = full_logits(kept, PROMPTS[3])
    torch.testing.assert_close(blocks, dequantized, atol=2e-3, rtol=0)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPTS[3]])).logits[0]
    torch.testing.assert_close(dequantized, expected, atol=0.3, rtol=0)
    kept = greedy_tokens(LLM(path, dtype="float32", kv_cache_memory="32MiB", quantization="gguf"), params=GREEDY)
    assert kept == greedy_tokens(LLM(path, dtype="float32", kv_cache_memory="32MiB", quantization="none"),
                                 params=GREEDY)


def test_gguf_mixed_expert_types_run_as_blocks(tmp_path):
    """Q4_0 gate/up with Q5_0 down (one kernel call per projection type), and Q4_1 experts: the blocks kept give
    the greedy tokens of the same file dequantized at load."""
    hf = tiny_moe("qwen3_moe", seed=3, norm_topk_prob=True)
    for name, overrides in [("mixed", {"experts.gate_up": "Q4_0", "experts.down": "Q5_0"}),
                            ("q4_1", {"experts": "Q4_1"})]:
        path = save_gguf(hf, str(tmp_path / f"{name}.gguf"), quant="Q8_0", overrides=overrides)
        kept = LLM(path, dtype="float32", kv_cache_memory="32MiB", quantization="gguf")
        _assert_experts_are_blocks(kept.engine.executor.worker.model)
        assert greedy_tokens(kept, params=GREEDY) == greedy_tokens(
            LLM(path, dtype="float32", kv_cache_memory="32MiB", quantization="none"), params=GREEDY), name


@pytest.mark.multiproc
def test_tensor_parallel_splits_every_expert_of_blocks(ops, tmp_path):
    """Q8_0 experts at tp = 2: each rank keeps its rows of gate and up and its columns of down (on block
    boundaries), as blocks. The logits equal one process's up to the order int8 block products are summed in,
    which moves an activation's int8 code now and then, three layers on."""
    from qwenserve.model.loader.model_loader import LoadedModel
    from qwenserve.worker.model_runner import full_logits
    hf = tiny_moe("qwen2_moe", seed=4, hidden_size=256, moe_intermediate_size=768, shared_expert_intermediate_size=64)
    path = save_gguf(hf, str(tmp_path / "tp.gguf"), quant="Q8_0")
    one = LoadedModel(path, dtype="float32", quantization="gguf").model
    _assert_experts_are_blocks(one)
    expected = full_logits(one, PROMPTS[3])
    results = tensor_parallel_logits(path, 2, PROMPTS[3], "gguf")
    for rank in range(2):
        torch.testing.assert_close(torch.from_numpy(results[rank]), expected, atol=1e-3, rtol=1e-3)


def test_expert_columns_split_inside_blocks_are_requantized_to_q8_0():
    """A rank's down columns that split the experts' Q4_K 256-blocks (768 at 384) become Q8_0 of the same weights;
    gate and up rows stay Q4_K, fused into one tensor; Q3_K (no kernel) experts become Q8_0. Each rank's stacked
    blocks, back in the file's layout, decode to its slice of every expert."""
    from qwenserve.distributed.tensor_parallel import TensorParallel
    from qwenserve.model.layers.quantization.gguf_experts import ExpertBlockCollector
    experts, hidden, inter = 3, 256, 768
    gate, up = random_experts(Q.Q4_K, experts, inter, hidden, 1), random_experts(Q.Q4_K, experts, inter, hidden, 2)
    down = random_experts(Q.Q4_K, experts, hidden, inter, 3)

    def blocks(raw, qtype, e):
        return GGMLTensor.from_bytes(raw[e], qtype, (raw.shape[1], raw.shape[2] // GGML_QUANT_SIZES[qtype][1]
                                                      * GGML_QUANT_SIZES[qtype][0]))

    def decoded(stacked, qtype, e, rows, cols):
        return GGMLTensor(stacked[e].contiguous(), qtype, (rows, cols), DECODE_GROUP).dequantize()

    for rank in range(2):
        collector = ExpertBlockCollector(experts, hidden, inter // 2, TensorParallel(rank, 2))
        for e in range(experts):
            for part, raw in (("gate", gate), ("up", up), ("down", down)):
                collector.load(part, e, blocks(raw, Q.Q4_K, e))
        stacked = collector.stack()
        assert (stacked.gate_type, stacked.down_type, stacked.up, stacked.group) == (int(Q.Q4_K), int(Q.Q8_0), None,
                                                                                     DECODE_GROUP)
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        for e in range(experts):
            want_gate_up = torch.cat([blocks(gate, Q.Q4_K, e).dequantize()[half],
                                      blocks(up, Q.Q4_K, e).dequantize()[half]])
            assert torch.equal(decoded(stacked.gate, Q.Q4_K, e, inter, hidden), want_gate_up)
            want_down = blocks(down, Q.Q4_K, e).dequantize()[:, half]
            got_down = decoded(stacked.down, Q.Q8_0, e, hidden, inter // 2)
            assert (got_down - want_down).abs().max() <= want_down.abs().max() / 127
    collector = ExpertBlockCollector(1, hidden, hidden, TensorParallel())
    q3 = GGMLTensor.from_bytes(torch.from_numpy(np.random.default_rng(5).integers(
        0, 256, size=(hidden, hidden // 256 * GGML_QUANT_SIZES[Q.Q3_K][1]), dtype=np.uint8)), Q.Q3_K, (hidden, hidden))
    q3 = GGMLTensor(q3.raw.clone(), Q.Q3_K, q3.shape)
    q3.raw.view(hidden, -1, GGML_QUANT_SIZES[Q.Q3_K][1])[..., -2:] = torch.tensor([0x00, 0x1c], dtype=torch.uint8)
    for part in ("gate", "up", "down"):
        collector.load(part, 0, q3)
    stacked = collector.stack()
    assert (stacked.gate_type, stacked.down_type) == (int(Q.Q8_0), int(Q.Q8_0))
    want = q3.dequantize()
    got = decoded(stacked.down, Q.Q8_0, 0, hidden, hidden)
    assert (got - want).abs().max() <= want.abs().max() / 127


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
    with pytest.raises(RequestError, match="mlp.shared_expert.gate_proj.lora_A.weight' is a LoRA weight of a "
                                           "mixture-of-experts layer's shared expert: .* not supported"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=experts)
    assert greedy_tokens(llm, [PROMPTS[1]], GREEDY)  # the engine serves on
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_lora_on_a_sparse_layers_mlp_is_refused_before_any_request(tmp_path):
    """An adapter of a sparse layer's gate/up/down (written by hand: that layer has no such modules for PEFT to
    find) is refused where the engine checks adapters, naming the layer: add_lora, and the server's
    /v1/load_lora_adapter with a 400, at the dense width or an expert's; the dense layer's MLP is adapted as in a
    dense model."""
    import httpx
    from safetensors.torch import save_file

    from qwenserve import LoRARequest
    from qwenserve.config.engine_config import EngineConfig
    from qwenserve.config.errors import RequestError
    from qwenserve.engine.async_engine import AsyncLLMEngine
    from qwenserve.engine.llm_engine import LLMEngine
    from qwenserve.entrypoints.openai.api_server import build_app

    from helpers import live_server
    hf = tiny_moe("qwen3_moe", seed=4, mlp_only_layers=[1], norm_topk_prob=True)
    base = save_hf_dir(hf, str(tmp_path / "base"))
    g = torch.Generator().manual_seed(0)
    written = {}

    def adapter(name, layer, widths):
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                              "target_modules": list(widths)}))
        prefix = f"base_model.model.model.layers.{layer}.mlp"
        tensors = {f"{prefix}.{module}.lora_{kind}.weight": 0.3 * torch.randn(shape, generator=g)
                   for module, (n_in, n_out) in widths.items() for kind, shape in (("A", (4, n_in)), ("B", (n_out, 4)))}
        save_file(tensors, str(path / "adapter_model.safetensors"))
        written[name] = tensors
        return str(path)
    dense_widths = {"gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}
    dense_layer = adapter("dense1", 1, dense_widths)
    sparse = [(0, "gate_proj", adapter("sparse0", 0, {"gate_proj": (64, 96)})),  # the dense MLP's width
              (2, "down_proj", adapter("sparse2", 2, {"down_proj": (32, 64)}))]  # an expert's
    llm = LLM(base, dtype="float32", kv_cache_memory="8MiB", enable_lora=True, max_lora_rank=4)
    llm.engine.add_lora(LoRARequest("dense1", 1, dense_layer))
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("dense1", 1, dense_layer))[0]
    with torch.no_grad():  # the reference: the adapter merged into the dense MLP's weights (scaling alpha / r = 2)
        for module in dense_widths:
            name = f"base_model.model.model.layers.1.mlp.{module}.lora_"
            getattr(hf.model.layers[1].mlp, module).weight += 2 * written["dense1"][name + "B.weight"] @ \
                written["dense1"][name + "A.weight"]
    adapted = list(out.outputs[0].token_ids)
    assert_hf_greedy(hf, [PROMPTS[0]], [adapted])
    assert adapted != greedy_tokens(llm, [PROMPTS[0]], GREEDY)[0]
    for layer, module, path in sparse:
        with pytest.raises(RequestError, match=f"adapts layer {layer}'s {module}, which is a mixture-of-experts "
                                               "layer's: LoRA on a mixture-of-experts layer's experts is not"):
            llm.engine.add_lora(LoRARequest(f"sparse{layer}", 2 + layer, path))
    assert llm.engine.list_loras() == {1}
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=base, dtype="float32", kv_cache_memory="8MiB",
                                                               enable_lora=True, max_lora_rank=4)))
    try:
        with live_server(build_app(engine, ["moe"], allow_runtime_lora_updating=True)) as url:
            for layer, module, path in sparse:
                r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": f"sparse{layer}", "lora_path": path},
                               timeout=30)
                assert r.status_code == 400, r.text
                assert f"adapts layer {layer}'s {module}, which is a mixture-of-experts" in r.json()["error"]["message"]
            r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "dense1", "lora_path": dense_layer},
                           timeout=30)
            assert r.status_code == 200, r.text
    finally:
        engine.shutdown()


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


# ---------------------------------------------------------------------------------------------------------------
# expert parallelism (enable_expert_parallel): whole experts per tensor-parallel rank

def _rank(rank: int, size: int, reduce: bool = True):
    """TensorParallel of expert parallelism at this rank; reduce=False: all_reduce returns this rank's part, so
    one process can build every rank and sum their parts itself."""
    from qwenserve.distributed.tensor_parallel import TensorParallel

    class ThisRankOnly(TensorParallel):
        def all_reduce(self, x):
            return x

    return (TensorParallel if reduce else ThisRankOnly)(rank, size, expert_parallel=True)


def test_expert_parallel_places_contiguous_ranges_and_sums_to_every_expert():
    """vLLM's placement (ranges, the remainder on the first ranks); the ranks' parts, each from its own experts
    only, add up to one process's output, with tokens that use no expert of some rank."""
    from qwenserve.distributed.layout import local_experts
    from qwenserve.distributed.tensor_parallel import TensorParallel
    assert [local_experts(6, _rank(r, 4)) for r in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 1)]
    assert [local_experts(6, _rank(r, 2)) for r in range(2)] == [(0, 3), (3, 3)]
    torch.manual_seed(1)
    full = FusedExperts(5, 16, 8, TensorParallel())
    full.w13.normal_(0, 0.3)
    full.w2.normal_(0, 0.3)
    x, ids = torch.randn(6, 16), torch.tensor([[0, 1], [0, 2], [4, 3], [1, 0], [4, 4], [2, 3]])
    weights = torch.rand(ids.shape)
    parts = []
    for r in range(3):
        experts = FusedExperts(5, 16, 8, _rank(r, 3, reduce=False))
        first, count = experts.first_expert, experts.num_local_experts
        assert experts.w13.shape == (count, 16, 16) and experts.w2.shape == (count, 16, 8)  # whole experts
        experts.w13.copy_(full.w13[first:first + count])
        experts.w2.copy_(full.w2[first:first + count])
        assert all(p.numel() == 0 for e in range(5) if not first <= e < first + count
                   for p in getattr(experts, str(e)).parameters())
        parts.append(experts(x, weights, ids))
    assert [len(p.nonzero()) > 0 for p in parts] == [True, True, True]
    torch.testing.assert_close(sum(parts), full(x, weights, ids), atol=1e-5, rtol=1e-5)


def _loaded(path: str, tp, quantization: str = "none"):
    """One rank's model, loaded in this process (loading runs no collective)."""
    from qwenserve.config.engine_config import LoadConfig
    from qwenserve.model.loader.model_loader import load_model
    from qwenserve.model.loader.resolve import resolve_model
    return load_model(resolve_model(LoadConfig(model=path, dtype="float32", max_model_len=256,
                                               quantization=quantization)), tp=tp)


def test_expert_parallel_ranks_load_only_their_experts(moe):
    """Each rank's experts are its range of the checkpoint's, whole; the other experts hold nothing."""
    from qwenserve.distributed.tensor_parallel import TensorParallel
    _, path = moe
    one = _expert_layers(_loaded(path, TensorParallel()))
    for r in range(2):
        for full, experts in zip(one, _expert_layers(_loaded(path, _rank(r, 2)))):
            held = slice(3 * r, 3 * r + 3)
            assert (experts.first_expert, experts.num_local_experts) == (3 * r, 3)
            assert torch.equal(experts.w13, full.w13[held]) and torch.equal(experts.w2, full.w2[held])
            assert all(p.numel() == 0 for e in range(6) if e // 3 != r for p in getattr(experts, str(e)).parameters())


def test_expert_parallel_blocks_hold_only_their_experts(ops, tmp_path):
    """From a Q8_0 GGUF file each rank stacks the blocks of its experts only, the file's bytes unsplit."""
    from qwenserve.distributed.tensor_parallel import TensorParallel
    path = save_gguf(tiny_moe("qwen2_moe", seed=4), str(tmp_path / "ep.gguf"), quant="Q8_0")
    one = _expert_layers(_loaded(path, TensorParallel(), "gguf"))
    for r in range(2):
        ranks = _expert_layers(_loaded(path, _rank(r, 2), "gguf"))
        assert len(ranks) == len(one) == 3
        for full, experts in zip(one, ranks):
            held = slice(3 * r, 3 * r + 3)
            assert experts.w13 is None and experts.blocks.gate.shape[0] == 3
            for part in ("gate", "down"):
                assert torch.equal(getattr(experts.blocks, part), getattr(full.blocks, part)[held])
            assert all(p.numel() == 0 for p in experts.parameters())


@pytest.mark.multiproc
def test_expert_parallel_logits_equal_one_process(moe):
    from qwenserve.model.loader.model_loader import LoadedModel
    from qwenserve.worker.model_runner import full_logits
    _, path = moe
    expected = full_logits(LoadedModel(path, dtype="float32").model, PROMPTS[3])
    results = tensor_parallel_logits(path, 2, PROMPTS[3], expert_parallel=True)
    for rank in range(2):
        torch.testing.assert_close(torch.from_numpy(results[rank]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.multiproc
def test_expert_parallel_greedy_equals_one_process(tmp_path):
    """The engine's flag end to end: Qwen2-MoE with its shared expert (split across the ranks as usual)."""
    path = save_hf_dir(tiny_moe("qwen2_moe", seed=7), str(tmp_path / "hf"))
    one = greedy_tokens(LLM(path, dtype="float32", kv_cache_memory="32MiB"), params=GREEDY)
    ep = LLM(path, dtype="float32", kv_cache_memory="32MiB", tensor_parallel_size=2, enable_expert_parallel=True)
    assert greedy_tokens(ep, params=GREEDY) == one


@pytest.mark.multiproc
def test_expert_parallel_on_blocks(ops, tmp_path):
    """Q8_0 experts kept as blocks: each rank's ggml_moe call runs only its experts' (token, expert) pairs. Logits
    as close to one process's as the split experts' (test_tensor_parallel_splits_every_expert_of_blocks), and
    the engine's greedy tokens equal."""
    from qwenserve.model.loader.model_loader import LoadedModel
    from qwenserve.worker.model_runner import full_logits
    hf = tiny_moe("qwen3_moe", seed=8, norm_topk_prob=True)
    path = save_gguf(hf, str(tmp_path / "ep.gguf"), quant="Q8_0")
    expected = full_logits(LoadedModel(path, dtype="float32", quantization="gguf").model, PROMPTS[3])
    results = tensor_parallel_logits(path, 2, PROMPTS[3], "gguf", expert_parallel=True)
    for rank in range(2):
        torch.testing.assert_close(torch.from_numpy(results[rank]), expected, atol=1e-3, rtol=1e-3)
    one = greedy_tokens(LLM(path, dtype="float32", kv_cache_memory="32MiB", quantization="gguf"), params=GREEDY)
    ep = LLM(path, dtype="float32", kv_cache_memory="32MiB", quantization="gguf", tensor_parallel_size=2,
             enable_expert_parallel=True)
    assert greedy_tokens(ep, params=GREEDY) == one


def test_expert_parallel_settings(tmp_path):
    """The flag: a CLI flag and keyword, off by default; at tensor_parallel_size 1 and on a model without experts
    it changes nothing; fewer experts than ranks is a ConfigError naming both, before any worker starts."""
    import argparse
    import json

    from qwenserve.config.engine_config import EngineConfig
    from qwenserve.distributed.layout import check_parallel_layout
    from qwenserve.distributed.tensor_parallel import TensorParallel
    from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert not engine_config_from_args(parser.parse_args([])).parallel.enable_expert_parallel
    assert engine_config_from_args(parser.parse_args(["--enable-expert-parallel"])).parallel.enable_expert_parallel
    one_rank = FusedExperts(6, 16, 8, TensorParallel(0, 1, expert_parallel=True))
    assert not one_rank.expert_parallel and one_rank.w13.shape[0] == 6
    path = save_hf_dir(tiny_moe("qwen3_moe", seed=9), str(tmp_path / "hf"))
    assert greedy_tokens(LLM(path, dtype="float32", kv_cache_memory="32MiB", enable_expert_parallel=True),
                         params=GREEDY) == greedy_tokens(LLM(path, dtype="float32", kv_cache_memory="32MiB"),
                                                         params=GREEDY)
    with open(f"{path}/config.json") as f:
        config = ModelConfig.from_hf_dict(json.load(f))
    check_parallel_layout(dataclasses.replace(config, extra={}), 2, 1, None, expert_parallel=True)  # no experts
    message = "num_experts 1 is less than tensor_parallel_size 2"
    with pytest.raises(ConfigError, match=message):
        check_parallel_layout(dataclasses.replace(config, extra={**config.extra, "num_experts": 1}), 2, 1, None,
                              expert_parallel=True)
    with pytest.raises(ConfigError, match=message):
        FusedExperts(1, 16, 8, TensorParallel(0, 2, expert_parallel=True))
    few = save_hf_dir(tiny_moe("qwen3_moe", num_experts=1, num_experts_per_tok=1), str(tmp_path / "one-expert"))
    with pytest.raises(ConfigError, match=message):
        LLM(few, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
    assert EngineConfig.from_kwargs(tensor_parallel_size=2, enable_expert_parallel=True).parallel.enable_expert_parallel


# ---------------------------------------------------------------------------------------------------------------
# ggml_moe, the experts on their blocks

Q = GGMLQuantizationType
# where each block format keeps its fp16 scale(s): random bytes there could be inf/nan
_SCALE_OFFSETS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_experts(qtype, experts: int, rows: int, cols: int, seed: int, scale: float = 0.02) -> torch.Tensor:
    """uint8 [experts, rows, row_bytes] of random ggml blocks whose fp16 scales are finite (uniform in +-scale)."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(experts * rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype]:
        blocks[:, off:off + 2] = rng.uniform(-scale, scale, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(experts, rows, cols // block_elems * block_bytes))


def in_decode_layout(raw: torch.Tensor, qtype, cols: int) -> torch.Tensor:
    """Each expert's rows regrouped by 8, as the layer stacks them."""
    return torch.stack([GGMLTensor.from_bytes(r, qtype, (r.shape[0], cols)).grouped().raw for r in raw])


def moe_loads(tokens: int, k: int, experts: int, seed: int) -> torch.Tensor:
    """ids [tokens, k]: expert 0 in most tokens (the busiest), the rest distinct random experts; with few tokens
    most experts get none."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    busy = torch.rand(tokens, generator=g) < 0.75
    for t in range(tokens):
        if busy[t] and 0 not in ids[t]:
            ids[t, 0] = 0
    return ids


def moe_composed(ops, x, ids, weights, gate, up, down, types, hidden, inter, levels, group):
    """The experts' sum from ggml_mm calls in float32 on the same layout (the same quantization of x and of h, the
    same kernels, expert by expert)."""
    out = torch.zeros(x.shape[0], hidden)
    xf = x.float()
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        rows = xf[tokens].contiguous()
        g, u, y = torch.empty(len(rows), inter), torch.empty(len(rows), inter), torch.empty(len(rows), hidden)
        ops.ggml_mm(g, rows, gate[e], int(types[0]), group, None, levels)
        ops.ggml_mm(u, rows, up[e], int(types[1]), group, None, levels)
        ops.ggml_mm(y, (F.silu(g) * u).contiguous(), down[e], int(types[2]), group, None, levels)
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out


def moe_dense(ops, x, ids, weights, gate, up, down, types, hidden, inter):
    """The dense math on the experts dequantized by ggml_dequantize, in float64."""
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            w_gate, w_up, w_down = (ops.ggml_dequantize(raw[e], int(q), cols, torch.float32).double()
                                    for raw, q, cols in ((gate, types[0], hidden), (up, types[1], hidden),
                                                         (down, types[2], inter)))
            xt = x[t].double()
            out[t] += weights[t, slot] * (w_down @ (F.silu(w_gate @ xt) * (w_up @ xt)))
    return out


MOE_CASES = {  # gate, up and down types
    "Q4_K": (Q.Q4_K,) * 3, "Q6_K": (Q.Q6_K,) * 3, "Q8_0": (Q.Q8_0,) * 3, "Q5_0": (Q.Q5_0,) * 3,
    "Q4_0": (Q.Q4_0,) * 3,
    # gate and up of different types, and of different activation blocks (q8_0, q8_K); down of a third
    "Q8_0-Q4_K-Q6_K": (Q.Q8_0, Q.Q4_K, Q.Q6_K),
}


MOE_LOADS = [(1, 1), (1, 4), (3, 2), (40, 1), (40, 4), (3, 4)]  # (tokens, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_ggml_moe_equals_the_experts_composed_and_dense(ops, case, dtype):
    """Tokens 1, 3 and 40 with k of 1, 2 and 4 (repeated experts across tokens, one expert in most tokens, experts
    with none), rows grouped by 1 and by 8, one and two activation codes; gate and up fused into one tensor where
    their types match, and passed apart."""
    check_ggml_moe(ops, case, dtype, MOE_LOADS)


@pytest.mark.kernels
def test_ggml_moe_on_the_portable_variant(ops):
    """The same on the baseline variant (x86_64: the scalar reference, no arch/ kernels; built on demand where no
    prebuilt library matches the sources)."""
    from qwenserve import kernels
    from qwenserve.config.cpu_variants import machine_arch, variants_for
    variants = variants_for(machine_arch())
    if not variants:
        pytest.skip(f"no kernel variants for {machine_arch()}")
    baseline = kernels.variant_ops(variants[0])
    for case in ("Q4_K", "Q5_0", "Q8_0-Q4_K-Q6_K"):
        check_ggml_moe(baseline, case, torch.float32, [(1, 4), (40, 4)])
    check_ggml_moe(baseline, "Q6_K", torch.bfloat16, [(3, 2)])


def check_ggml_moe(ops, case: str, dtype: torch.dtype, loads: list[tuple[int, int]]) -> None:
    types = MOE_CASES[case]
    experts, hidden, inter = 6, 256, 256
    gate = random_experts(types[0], experts, inter, hidden, seed=1)
    up = random_experts(types[1], experts, inter, hidden, seed=2)
    down = random_experts(types[2], experts, hidden, inter, seed=3)
    grouped = [in_decode_layout(raw, q, cols) for raw, q, cols in ((gate, types[0], hidden), (up, types[1], hidden),
                                                                   (down, types[2], inter))]
    for tokens, k in loads:
        g = torch.Generator().manual_seed(tokens * 10 + k)
        x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
        ids = moe_loads(tokens, k, experts, seed=tokens + k)
        weights = torch.rand(tokens, k, generator=g)
        dense = moe_dense(ops, x, ids, weights, gate, up, down, types, hidden, inter)
        for levels in (1, 2):
            for group, (g_raw, u_raw, d_raw) in ((1, (gate, up, down)), (DECODE_GROUP, grouped)):
                composed = moe_composed(ops, x, ids, weights, g_raw, u_raw, d_raw, types, hidden, inter, levels,
                                        group)
                calls = [(g_raw, u_raw)]
                if types[0] == types[1]:
                    calls.append((torch.cat([g_raw, u_raw], dim=1), None))
                for first, second in calls:
                    got = ops.ggml_moe(x, ids, weights, first, int(types[0]), second, int(types[1]), d_raw,
                                       int(types[2]), group, levels)
                    where = (case, tokens, k, levels, group, second is None)
                    assert got.dtype == dtype and got.shape == (tokens, hidden), where
                    rounding = 1e-5 if dtype == torch.float32 else 2.0 ** -8
                    torch.testing.assert_close(got.float(), composed.to(dtype).float(), atol=rounding * 4 *
                                               composed.abs().max().item(), rtol=rounding * 2, msg=str(where))
                    # the layer itself: off the dense math by the int8 rounding of x and of h (heavy-tailed, a product
                    # of two projections: its blocks' steps are coarse next to most of its values), far less with
                    # two codes each
                    assert (got.double() - dense).norm() <= (0.05 if levels == 1 else 0.005) * dense.norm(), where


def test_ggml_moe_rejects_bad_arguments(ops):
    """An expert id out of range, and shapes or types that do not fit, are errors that say so (no crash)."""
    gate = random_experts(Q.Q8_0, 4, 32, 64, seed=1)
    down = random_experts(Q.Q8_0, 4, 64, 32, seed=2)
    x, weights = torch.randn(2, 64), torch.rand(2, 2)
    q8 = int(Q.Q8_0)
    for bad in (4, -1, 1000):
        ids = torch.tensor([[0, 1], [bad, 2]])
        with pytest.raises(RuntimeError, match=f"expert id {bad} \\(token 1, slot 0\\) is out of range: the layer "
                                               "has 4 experts"):
            ops.ggml_moe(x, ids, weights, gate, q8, gate, q8, down, q8, 1, 1)
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(RuntimeError, match="ids must be a contiguous int64"):
        ops.ggml_moe(x, ids.int(), weights, gate, q8, gate, q8, down, q8, 1, 1)
    with pytest.raises(RuntimeError, match="weights must be a contiguous float32"):
        ops.ggml_moe(x, ids, weights.double(), gate, q8, gate, q8, down, q8, 1, 1)
    with pytest.raises(RuntimeError, match="down has 32 rows per expert, x 64 columns"):
        ops.ggml_moe(x, ids, weights, gate, q8, gate, q8, random_experts(Q.Q8_0, 4, 32, 32, seed=3), q8, 1, 1)
    with pytest.raises(RuntimeError, match="up holds 3 experts, gate holds 4"):
        ops.ggml_moe(x, ids, weights, gate, q8, gate[:3].contiguous(), q8, down, q8, 1, 1)
    with pytest.raises(RuntimeError, match="has rows of 34 bytes; 32 weights take 18"):
        ops.ggml_moe(x, ids, weights, gate, q8, gate, q8, down, int(Q.Q4_0), 1, 1)
    with pytest.raises(RuntimeError, match="act_levels must be 1 or 2, not 3"):
        ops.ggml_moe(x, ids, weights, gate, q8, gate, q8, down, q8, 1, 3)
    with pytest.raises(RuntimeError, match="not supported"):
        ops.ggml_moe(x, ids, weights, gate, int(Q.Q2_K), gate, q8, down, q8, 1, 1)

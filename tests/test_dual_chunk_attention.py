"""Dual-chunk attention (dual_chunk_attention_config, or hf_overrides): against a plain PyTorch reference written
here from the published definition (every query-key logit from the three rotated queries, one softmax, no
chunking of the computation); paged, chunked and prefix-cached runs against it; a sequence within one chunk
equal to ordinary attention to the bit; int8 / fp8 caches; the configs that are refused and their errors."""
import argparse
import copy
import json
import math
import os

import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.config.dual_chunk_config import DualChunkConfig
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import ModelConfig
from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args
from qwenserve.model.layers.decode_layers import runs_every_part
from qwenserve.model.layers.dual_chunk_attention import blocked_attention
from qwenserve.worker.model_runner import full_logits

from helpers import save_gguf, save_hf_dir, tiny_hf_model

THETA = 10000.0
# chunks of 16 tokens, distances up to 24; the temperature starts past 32 tokens
DCA = {"chunk_size": 24, "local_size": 8, "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, its directory): 4 query heads on 2 kv heads of width 16, two layers, 256 positions."""
    hf = tiny_hf_model(seed=49, rope_theta=THETA, max_position_embeddings=256)
    return hf, save_hf_dir(hf, str(tmp_path_factory.mktemp("dca")))


def dca_llm(path, dca=DCA, **kw):
    kw.setdefault("kv_cache_memory", "4MiB")
    return LLM(path, dtype="float32", record_logits=True, hf_overrides={"dual_chunk_attention_config": dca}, **kw)


# ---- the reference ---------------------------------------------------------------------------------------------

def rotate(x, positions, head_dim):
    """Neox RoPE of x [T, heads, d] at positions [T], in float64 from scratch."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None, :], torch.cat([angle.sin()] * 2, -1)[:, None, :]
    half = head_dim // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin


def temperature(length, original):
    return max(1.0, 0.1 * math.log(length / original) + 1.0) if original else 1.0


def reference_logits(hf, ids, dca, prompt_len=None):
    """Logits [T, vocab] of the sequence ids (its first prompt_len tokens the prompt) under DCA as published:
    chunk length L = chunk_size - local_size; key j rotated at j mod L; query i rotated at i mod L against keys
    of its own chunk, at min(i mod L + L, chunk_size) against the chunk before, at min(2L - 1, chunk_size)
    against older chunks; logits scaled by head_dim^-0.5 and by the temperatures of query and key
    (t(max(prompt, position + 1))); one causal softmax over all keys."""
    T = len(ids)
    prompt_len = prompt_len or T
    L, size, original = dca["chunk_size"] - dca["local_size"], dca["chunk_size"], dca.get(
        "original_max_position_embeddings", 0)
    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // heads
    pos = torch.arange(T)
    chunk = pos // L
    same = chunk[:, None] == chunk[None, :]
    previous = chunk[:, None] == chunk[None, :] + 1
    causal = pos[:, None] >= pos[None, :]
    t = torch.tensor([temperature(max(prompt_len, i + 1), original) for i in range(T)], dtype=torch.float64)
    factor = t[:, None] * t[None, :] * d ** -0.5
    model = copy.deepcopy(hf).double()
    with torch.no_grad():
        x = model.model.embed_tokens(torch.tensor(ids))
        for layer in model.model.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(T, heads, d)
            k = a.k_proj(h).view(T, kv_heads, d).repeat_interleave(heads // kv_heads, 1)
            v = a.v_proj(h).view(T, kv_heads, d).repeat_interleave(heads // kv_heads, 1)
            key = rotate(k, pos % L, d)
            q_intra = rotate(q, pos % L, d)
            q_succ = rotate(q, (pos % L + L).clamp(max=size), d)
            q_inter = rotate(q, torch.full_like(pos, min(2 * L - 1, size)), d)
            scores = torch.where(same[None], torch.einsum("ihd,jhd->hij", q_intra, key),
                                 torch.where(previous[None], torch.einsum("ihd,jhd->hij", q_succ, key),
                                             torch.einsum("ihd,jhd->hij", q_inter, key)))
            scores = (scores * factor).masked_fill(~causal, float("-inf"))
            out = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).reshape(T, heads * d)
            x = x + a.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(model.model.norm(x)).float()


def ids_of(n, seed, vocab=300):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(llm, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_steps_match_reference(hf, prompt, output, dca, atol=2e-4):
    """Each generated token's logits equal the reference's at its position (prompt + tokens before it)."""
    tokens = list(output.outputs[0].token_ids)
    expected = reference_logits(hf, prompt + tokens[:-1], dca, prompt_len=len(prompt))[len(prompt) - 1:]
    got = torch.stack([torch.as_tensor(x) for x in output.outputs[0].logits])
    torch.testing.assert_close(got, expected, atol=atol, rtol=1e-4)


# ---- the definition ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dca", [DCA, {"chunk_size": 20, "local_size": 2}], ids=["temperature", "wide-chunks"])
def test_one_prefill_over_several_chunks_equals_the_reference(tiny, dca):
    """70 tokens: 5 chunks of 16 (4 of 18); inter attention from the third chunk on; the temperature past 32."""
    hf, path = tiny
    ids = ids_of(70, seed=1)
    got = full_logits(dca_llm(path, dca).engine.executor.worker.model, ids)
    torch.testing.assert_close(got, reference_logits(hf, ids, dca), atol=2e-4, rtol=1e-4)


def test_reference_differs_from_ordinary_attention_past_one_chunk(tiny):
    """The comparisons above can fail: past the first chunk DCA's logits are not ordinary attention's, within it
    (and below the temperature's threshold) they are."""
    hf, _ = tiny
    ids = ids_of(40, seed=2)
    with torch.no_grad():
        ordinary = hf(torch.tensor([ids])).logits[0]
    dca = reference_logits(hf, ids, {"chunk_size": 24, "local_size": 8})
    torch.testing.assert_close(dca[:16], ordinary[:16], atol=2e-4, rtol=1e-4)
    assert (dca[16:] - ordinary[16:]).abs().max() > 1e-2


def test_paged_chunked_prefill_and_decode_across_chunks_equal_the_reference(tiny):
    """Prefill in steps of 12 tokens (chunk boundaries 16, 32, 48 fall inside steps), blocks of 8 (each step
    reads its context back from the paged cache), then decode from position 50 across the boundaries at 64
    and 80 to 85, with the temperature growing as it goes."""
    hf, path = tiny
    llm = dca_llm(path, block_size=8, max_num_batched_tokens=12, enable_prefix_caching=False)
    prompt = ids_of(50, seed=3)
    out = generate(llm, [prompt], max_tokens=36)[0]
    assert_steps_match_reference(hf, prompt, out, DCA)


def test_prefix_cached_prompt_equals_the_reference_and_the_uncached_run(tiny):
    """Below the temperature's threshold a prompt reuses the blocks another prompt (of another length) wrote, and
    still equals the reference and a run without prefix caching."""
    hf, path = tiny
    dca = dict(DCA, original_max_position_embeddings=128)
    first, second = ids_of(60, seed=4), ids_of(60, seed=4)[:48] + ids_of(22, seed=5)
    cached = dca_llm(path, dca, block_size=16)
    generate(cached, [first], max_tokens=4)
    out = generate(cached, [second], max_tokens=12)[0]
    assert out.num_cached_tokens == 48
    assert_steps_match_reference(hf, second, out, dca)
    plain = generate(dca_llm(path, dca, block_size=16, enable_prefix_caching=False), [second], max_tokens=12)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    torch.testing.assert_close(torch.stack([torch.as_tensor(x) for x in out.outputs[0].logits]),
                               torch.stack([torch.as_tensor(x) for x in plain.outputs[0].logits]),
                               atol=1e-5, rtol=1e-5)


def test_past_the_threshold_only_prompts_of_one_length_share_blocks(tiny):
    """Past original_max_position_embeddings every layer's K/V depend on the prompt's length (its temperature):
    a prompt of another length gets no cached block, one of the same length does, and equals the reference."""
    hf, path = tiny
    llm = dca_llm(path, block_size=16)
    generate(llm, [ids_of(60, seed=4)], max_tokens=2)
    other_length = generate(llm, [ids_of(60, seed=4)[:48] + ids_of(22, seed=5)], max_tokens=2)[0]
    assert other_length.num_cached_tokens == 0
    same_length = ids_of(60, seed=4)[:48] + ids_of(12, seed=6)
    out = generate(llm, [same_length], max_tokens=10)[0]
    assert out.num_cached_tokens == 48
    assert_steps_match_reference(hf, same_length, out, DCA)


def test_a_batch_of_sequences_at_different_chunks(tiny):
    """Decode steps batching sequences in their first, second and third chunk, each at its own length."""
    hf, path = tiny
    llm = dca_llm(path, block_size=8)
    prompts = [ids_of(n, seed=10 + n) for n in (5, 20, 41)]
    for prompt, out in zip(prompts, generate(llm, prompts, max_tokens=14)):
        assert_steps_match_reference(hf, prompt, out, DCA)


def test_within_one_chunk_dca_is_ordinary_attention_to_the_bit(tiny):
    """A prompt and its decode shorter than one chunk, below the temperature's threshold: the same logits, bit
    for bit, as the same checkpoint without DCA (prefill and every decode step)."""
    _, path = tiny
    dca = {"chunk_size": 96, "local_size": 16, "original_max_position_embeddings": 128}
    prompt = ids_of(50, seed=6)
    plain = LLM(path, dtype="float32", record_logits=True, kv_cache_memory="4MiB")
    ours = dca_llm(path, dca)
    assert torch.equal(full_logits(ours.engine.executor.worker.model, prompt),
                       full_logits(plain.engine.executor.worker.model, prompt))
    a, b = generate(plain, [prompt], 20)[0], generate(ours, [prompt], 20)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a.outputs[0].logits,
                                                                                    b.outputs[0].logits))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_cache(tiny, kv_cache_dtype):
    """An int8 / fp8 cache under DCA (codes read back dequantized in each part): logits near the reference's,
    within the codes' rounding, through chunked prefill and decode across a chunk boundary."""
    hf, path = tiny
    llm = dca_llm(path, kv_cache_dtype=kv_cache_dtype, block_size=8, max_num_batched_tokens=12)
    prompt = ids_of(40, seed=7)
    out = generate(llm, [prompt], max_tokens=12)[0]
    tokens = list(out.outputs[0].token_ids)
    expected = reference_logits(hf, prompt + tokens[:-1], DCA, prompt_len=len(prompt))[len(prompt) - 1:]
    got = torch.stack([torch.as_tensor(x) for x in out.outputs[0].logits])
    err = (got - expected).abs().max() / expected.abs().max()
    assert 0 < err < (0.02 if kv_cache_dtype == "int8" else 0.08), err


def test_the_fused_decode_call_declines_dca_layers(tiny):
    """The one-call decode has no DCA: a DCA layer's declared parts are not the ones it runs."""
    _, path = tiny
    plain = LLM(path, dtype="float32", kv_cache_memory="4MiB").engine.executor.worker.model
    ours = dca_llm(path).engine.executor.worker.model
    assert all(runs_every_part(layer) for layer in plain.model.own_layers)
    assert not any(runs_every_part(layer) for layer in ours.model.own_layers)


def test_blocked_attention_equals_the_flash_kernel():
    """The PyTorch path (devices without torch's CPU flash kernel): output and log-sum-exp of a GQA attention,
    causal and not, over more keys than one block."""
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(4, 300, 16, generator=g), torch.randn(2, 1500, 16, generator=g), torch.randn(
        2, 1500, 16, generator=g)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    for causal, keys in ((False, 1500), (True, 300)):
        out, lse = blocked_attention(q, k[:, :keys], v[:, :keys], 0.25, causal)
        ref_out, ref_lse = flash(q[None], k[None, :, :keys], v[None, :, :keys], 0.0, causal, scale=0.25)
        torch.testing.assert_close(out, ref_out[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse[0], atol=1e-5, rtol=1e-5)


def test_hf_overrides_turn_dca_on_for_a_gguf_file(tiny, tmp_path):
    hf, _ = tiny
    path = save_gguf(hf, str(tmp_path / "tiny.gguf"), quant="F32")
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB",
              hf_overrides=json.dumps({"dual_chunk_attention_config": DCA}))
    assert llm.engine.config.resolved_model.config.dual_chunk == DualChunkConfig(**DCA)
    ids = ids_of(40, seed=9)
    torch.testing.assert_close(full_logits(llm.engine.executor.worker.model, ids), reference_logits(hf, ids, DCA),
                               atol=2e-4, rtol=1e-4)


# ---- refused configs --------------------------------------------------------------------------------------------

def test_the_sparse_part_is_refused_with_how_to_turn_it_off(tiny, tmp_path):
    _, path = tiny
    sparse = dict(DCA, sparse_attention_config=[{"0": ["vertical_and_slash", 1000, 6096, 0.9]}])
    with pytest.raises(ConfigError, match=r"sparse_attention_config.*sparse_attention_enabled.*--hf-overrides"):
        dca_llm(path, sparse)
    with pytest.raises(ConfigError, match="sparse_attention_enabled"):
        dca_llm(path, dict(DCA, sparse_attention_enabled=True))
    dca_llm(path, dict(sparse, sparse_attention_enabled=False))  # off: dense DCA runs
    # Qwen's 1M checkpoints keep the sparse part in a file beside config.json
    with open(os.path.join(path, "sparse_attention_config.json"), "w") as f:
        json.dump(sparse["sparse_attention_config"], f)
    try:
        with pytest.raises(ConfigError, match=r"sparse_attention_config\.json.*sparse_attention_enabled"):
            dca_llm(path)
        dca_llm(path, dict(DCA, sparse_attention_enabled=False))
    finally:
        os.remove(os.path.join(path, "sparse_attention_config.json"))


@pytest.mark.parametrize("dca,field", [
    ({"chunk_size": 16, "local_size": 16}, "local_size"),
    ({"chunk_size": 16, "local_size": 20}, "local_size"),
    ({"chunk_size": 0, "local_size": 4}, "chunk_size"),
    ({"chunk_size": 16, "local_size": 0}, "local_size"),
    ({"chunk_size": 16, "local_size": -2}, "local_size"),
    ({"chunk_size": 16.5, "local_size": 2}, "chunk_size"),
    ({"chunk_size": 16, "local_size": 2, "original_max_position_embeddings": -1}, "original_max_position_embeddings"),
    ({"local_size": 2}, "chunk_size"),
    ({"chunk_size": 16, "local_size": 2, "chunk_len": 3}, "chunk_len"),
    ({"chunk_size": 16, "local_size": 2, "sparse_attention_enabled": "no"}, "sparse_attention_enabled"),
    ([16, 2], "must be an object"),
])
def test_bad_dca_configs_name_the_field(dca, field):
    base = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ConfigError, match=f"dual_chunk_attention_config.*{field}|{field}.*dual_chunk"):
        ModelConfig.from_hf_dict({**base, "dual_chunk_attention_config": dca})


def test_dca_with_rope_scaling_is_refused():
    base = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    with pytest.raises(ConfigError, match="dual_chunk_attention_config and rope_scaling"):
        ModelConfig.from_hf_dict({**base, "dual_chunk_attention_config": {"chunk_size": 16, "local_size": 2}})


@pytest.mark.parametrize("value,match", [('{"dual_chunk_attention_config": {', "not valid JSON"),
                                         ("[1, 2]", "JSON object"), ('"text"', "JSON object")])
def test_hf_overrides_that_are_not_a_json_object(tiny, value, match):
    _, path = tiny
    with pytest.raises(ConfigError, match=f"hf_overrides.*{match}|{match}"):
        LLM(path, hf_overrides=value)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(ConfigError, match="hf_overrides"):
        engine_config_from_args(parser.parse_args(["--model", path, "--hf-overrides", value]))


def test_hf_overrides_merge_nested_objects_and_clear_with_null(tiny):
    """A nested object merges key by key into the checkpoint's; null clears a field."""
    _, path = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB",
              hf_overrides={"dual_chunk_attention_config": DCA, "rope_scaling": None, "rms_norm_eps": 1e-5})
    config = llm.engine.config.resolved_model.config
    assert config.dual_chunk.chunk_len == 16 and config.rms_norm_eps == 1e-5


# ---- the benchmarks ---------------------------------------------------------------------------------------------

def test_bench_long_context_and_passkey_run_each_mode(tiny, capsys):
    """Both commands end to end on the tiny model (figures not asserted, only their shape)."""
    from qwenserve.entrypoints.cli.main import main
    _, path = tiny
    engine = ["--model", path, "--dtype", "float32", "--kv-cache-memory", "4MiB"]
    assert main(["bench", "long-context", *engine, "--lengths", "40", "70", "--output-len", "3", "--chunk-size", "24",
                 "--local-size", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["mode"], r["prompt_len"]) for r in result["runs"]] == [("no-dca", 40), ("no-dca", 70), ("dca", 40),
                                                                      ("dca", 70)]
    assert result["prefill_ratio_70"] > 0 and result["runs"][3]["kv_mib"] > result["runs"][2]["kv_mib"]
    assert main(["bench", "passkey", *engine, "--length", "240", "--depths", "0", "1", "--trials", "1",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["window"] == 60 and result["local_size"] == 7
    for mode in ("no-dca", "dca", "yarn"):
        assert 0 <= result[f"{mode}_retrieval"] <= 1 and len(result[f"{mode}_per_depth"]) == 2


def test_passkey_prompt_hides_the_key_at_its_depth(tiny):
    from qwenserve.benchmarks.passkey import passkey_prompt
    from qwenserve.model.loader.tokenizer import load_hf_tokenizer
    _, path = tiny
    tokenizer = load_hf_tokenizer(path)
    texts = {depth: tokenizer.decode(passkey_prompt(tokenizer, 400, depth, 12345)) for depth in (0.0, 0.5, 1.0)}
    assert texts[0.0].index("The pass key is 12345") < texts[0.0].index("The grass")
    assert texts[1.0].rindex("The grass") < texts[1.0].index("The pass key is 12345") < texts[1.0].index("What is")
    assert texts[0.5].index("The grass") < texts[0.5].index("12345") < texts[0.5].rindex("The grass")
    assert all(len(passkey_prompt(tokenizer, 400, d, 12345)) == 400 for d in (0.0, 0.3))


def test_qwen3_runs_dca_after_its_head_norms(tmp_path):
    """Qwen3 (q/k norms before the rotary): within one chunk the same logits as without DCA, to the bit; past it
    the parts apply (other logits, finite)."""
    from helpers import tiny_qwen3
    path = save_hf_dir(tiny_qwen3(seed=3), str(tmp_path / "qwen3"))
    ids = ids_of(60, seed=11)
    plain = full_logits(LLM(path, dtype="float32", kv_cache_memory="4MiB").engine.executor.worker.model, ids)
    ours = full_logits(dca_llm(path, {"chunk_size": 24, "local_size": 8}).engine.executor.worker.model, ids)
    assert torch.equal(ours[:16], plain[:16])
    assert ours.isfinite().all() and (ours[16:] - plain[16:]).abs().max() > 1e-3


def test_a_long_prefill_holds_no_score_matrix(tmp_path):
    """8192 tokens in one DCA prefill (chunks of 1024): the process's peak resident memory grows by far less than
    one [T, T] float32 score matrix of one head (256 MiB; all four heads': 1 GiB)."""
    from qwenserve.benchmarks.long_context import peak_rss_gib, reset_peak_rss
    if peak_rss_gib() is None:
        pytest.skip("no /proc/self/status VmHWM here")
    hf = tiny_hf_model(seed=50, max_position_embeddings=8192)
    path = save_hf_dir(hf, str(tmp_path / "long"))
    model = dca_llm(path, {"chunk_size": 1280, "local_size": 256}).engine.executor.worker.model
    ids = ids_of(8192, seed=12)
    full_logits(model, ids[:1100])  # one-off allocations (thread pools, kernels) before the measurement
    reset_peak_rss()
    before = peak_rss_gib()
    logits = full_logits(model, ids)
    grown = peak_rss_gib() - before
    assert logits.isfinite().all()
    assert grown < 0.1, f"peak RSS grew {grown:.2f} GiB over an 8192-token prefill"

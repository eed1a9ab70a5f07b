"""kv_cache_dtype: int8 / fp8 KV caches, one bf16 scale per token and kv head. The codes round-trip within
their format's rounding; the decode kernel on a quantized cache equals SDPA on the dequantized one; the engine's
greedy tokens stay those of the unquantized cache (nearly all of them) through prefix caching, chunked prefill
and preemption, leaking no block; the same memory holds about twice the blocks of a bfloat16 cache."""
import argparse

import pytest
import torch

from qwenserve import LLM, kernels
from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import ConfigError
from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args
from qwenserve.model.layers.attention import Attention, DecodeGroup, PagedKVCache, dequantize_kv, quantize_kv

from helpers import record_preemptions, save_hf_dir, tiny_hf_model
from test_engine import GREEDY, assert_no_leak, prompts, run

CODES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# (mantissa bits, exponent of the smallest subnormal) of each fp8 format
FP8 = {torch.float8_e4m3fn: (3, -9), torch.float8_e5m2: (2, -16)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """head_dim 64 (an AVX-512 kernel size), 4 query heads on 2 kv heads."""
    hf = tiny_hf_model(seed=41, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512)
    return save_hf_dir(hf, str(tmp_path_factory.mktemp("kv_dtype")))


@pytest.mark.parametrize("name", CODES)
def test_quantize_round_trip_within_the_formats_rounding(name):
    dtype = CODES[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 64, generator=g) * torch.logspace(-4, 3, 40).view(-1, 1, 1)  # magnitudes 1e-4 .. 1e3
    x[5, 1] = 0.0
    codes, scales = quantize_kv(x, dtype)
    assert codes.dtype == dtype and codes.shape == x.shape
    assert scales.dtype == torch.bfloat16 and scales.shape == x.shape[:2]
    assert scales[5, 1] == 0 and not codes[5, 1].float().any(), "a zero vector: scale 0, codes 0"
    top = torch.finfo(dtype).max if dtype.is_floating_point else 127
    nonzero = scales > 0
    torch.testing.assert_close(codes.float().abs().amax(-1)[nonzero], torch.full_like(scales[nonzero].float(), top))

    s = scales.float().unsqueeze(-1)
    err = (dequantize_kv(codes, s, torch.float32) - x).abs()
    if dtype == torch.int8:  # rounding to nearest: half a step
        bound = s / 2
    else:  # half an ulp of the code (relative), or half the subnormal spacing
        mantissa, subnormal = FP8[dtype]
        bound = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), s * 2.0 ** (subnormal - 1))
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()


def dequantized(cache: PagedKVCache, dtype: torch.dtype) -> PagedKVCache:
    """A cache of `dtype` holding the dequantized values of a one-layer quantized cache."""
    plain = PagedKVCache(1, *cache.k[0].shape, dtype)
    plain.k[0].copy_(dequantize_kv(cache.k[0], cache.k_scales[0].unsqueeze(-1), dtype))
    plain.v[0].copy_(dequantize_kv(cache.v[0], cache.v_scales[0].unsqueeze(-1), dtype))
    return plain


@pytest.mark.parametrize("name", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(8, 2, 64, 16), (6, 2, 24, 5), (4, 1, 32, 7)])
def test_decode_kernel_on_a_quantized_cache_equals_sdpa_on_the_dequantized(ops, name, dtype, heads, kv_heads,
                                                                          head_dim, block_size):
    """head_dim 64 and 32 take the AVX-512 kernels where the CPU has them, 24 the portable path everywhere."""
    g = torch.Generator().manual_seed(1)
    num_blocks, batch = 24, 6
    quantized = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, CODES[name])
    k, v = (torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype) * 2 for _ in range(2))
    quantized.write(0, torch.arange(num_blocks * block_size), k, v)

    lens = torch.tensor([1, block_size, block_size + 1, 17, 29, 36])  # across block boundaries
    width = -(-36 // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(batch)])
    mask = torch.arange(36).view(1, 1, 1, -1) < lens.view(-1, 1, 1, 1)
    group = DecodeGroup(None, tables, 36, mask, lens)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, :heads * head_dim].view(batch, heads, head_dim)  # strided, as the model hands it over
    attn = Attention(0, heads, kv_heads, head_dim, head_dim ** -0.5)

    # the SDPA path (kernels off) gathers, then dequantizes to the query's dtype
    sdpa = attn._decode_sdpa(q, quantized, group)
    assert torch.equal(sdpa, attn._decode_sdpa(q, dequantized(quantized, dtype), group))
    # the kernel dequantizes in float: against float32 SDPA, it differs by float rounding and its output's rounding
    expected = attn._decode_sdpa(q.float(), dequantized(quantized, torch.float32), group)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(attn._decode_kernel(q, quantized, group).float(), expected, atol=tol, rtol=tol)


def test_decode_kernel_wants_scales_exactly_for_quantized_caches(ops):
    codes, scales, q = torch.zeros(4, 2, 1, 16, dtype=torch.int8), torch.zeros(4, 2, 1), torch.zeros(1, 1, 16)
    args = (torch.tensor([[0, 1]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="need k_scales and v_scales"):
        ops.paged_decode_attention(torch.empty_like(q), q, codes, codes, *args)
    with pytest.raises(RuntimeError, match="need k_scales and v_scales"):
        ops.paged_decode_attention(torch.empty_like(q), q, codes.float(), codes.float(), *args, scales, scales)
    with pytest.raises(RuntimeError, match="scales must be contiguous bfloat16"):  # float32 scales: the old layout
        ops.paged_decode_attention(torch.empty_like(q), q, codes, codes, *args, scales, scales)


def agreement(reference, outputs):
    """(share of output tokens equal at their position, largest sampled-logprob gap before a sequence differs)."""
    same = total = 0
    gap = 0.0
    for a, b in zip(reference, outputs):
        a, b = a.outputs[0], b.outputs[0]
        same += sum(x == y for x, y in zip(a.token_ids, b.token_ids))
        total += len(a.token_ids)
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                break
            if a.logprobs:
                gap = max(gap, abs(a.logprobs[i][x].logprob - b.logprobs[i][y].logprob))
    return same / total, gap


@pytest.mark.slow
@pytest.mark.parametrize("use_kernels", [True, False])
def test_int8_cache_keeps_greedy_tokens_and_logprobs(tiny, use_kernels):
    ps = prompts([5, 40, 90, 17], seed=5)
    auto = run(LLM(tiny, dtype="float32", kv_cache_memory="4MiB"), ps, max_tokens=30, logprobs=1, **GREEDY)
    if use_kernels:
        llm = LLM(tiny, dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype="int8")
    else:
        with kernels.disabled():  # the layers pick the SDPA decode when built
            llm = LLM(tiny, dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype="int8")
    assert llm.engine.executor.worker.kv_cache.k[0].dtype == torch.int8
    same, gap = agreement(auto, run(llm, ps, max_tokens=30, logprobs=1, **GREEDY))
    assert same >= 0.9 and gap < 0.1, (same, gap)
    assert_no_leak(llm)


@pytest.mark.slow
def test_int8_cache_with_prefix_hits_chunked_prefill_and_preemption(tiny):
    shared = prompts([48], seed=6)[0]
    ps = [shared + tail for tail in prompts([7, 20, 1, 12, 30, 3], seed=7)]
    reference = run(LLM(tiny, dtype="float32", kv_cache_memory="8MiB"), ps, max_tokens=20, **GREEDY)
    # 2 layers * 2 (K, V) * 2 kv heads * (64 code bytes + a 2-byte scale) = 528 bytes a token: 12 blocks of 16
    # tokens, far less than the six requests need together (about 480 tokens); prompts prefilled 32 tokens a step
    llm = LLM(tiny, dtype="float32", kv_cache_dtype="int8", kv_cache_memory=12 * 16 * 528, max_num_batched_tokens=32)
    assert llm.engine.executor.num_kv_blocks == 12
    preempted = record_preemptions(llm)
    first = run(llm, ps[:1], max_tokens=20, **GREEDY)
    rest = run(llm, ps[1:], max_tokens=20, **GREEDY)
    assert preempted, "the test did not exercise preemption"
    assert any(o.num_cached_tokens >= 32 for o in rest), "the test did not hit the prefix cache"
    assert all(len(o.outputs[0].token_ids) == 20 for o in first + rest)
    same, _ = agreement(reference, first + rest)
    assert same >= 0.9, same
    assert_no_leak(llm)


def test_int8_holds_about_twice_the_blocks_of_bfloat16(tiny, caplog):
    def blocks(kv_cache_dtype):
        return LLM(tiny, dtype="bfloat16", kv_cache_memory="1MiB",
                   kv_cache_dtype=kv_cache_dtype).engine.executor.num_kv_blocks

    with caplog.at_level("INFO", logger="qwenserve.worker.worker"):
        bf16, int8 = blocks("auto"), blocks("int8")
    assert int8 >= 1.92 * bf16  # head_dim 64: 64 code bytes + a 2-byte scale against 128 bytes, 1.94x
    assert "(bfloat16)" in caplog.text and "(int8 codes" in caplog.text
    for codes in CODES.values():  # head_dim 128 (larger Qwen2 models): 130 bytes against 256, 1.97x
        per_block = PagedKVCache.bytes_per_block(24, 16, 2, 128, codes)
        assert PagedKVCache.bytes_per_block(24, 16, 2, 128, torch.bfloat16) >= 1.96 * per_block


def test_the_setting_is_a_flag_and_keyword_validated_with_its_values(monkeypatch):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])).cache.kv_cache_dtype == \
        "fp8_e5m2"
    assert EngineConfig.from_kwargs().cache.kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp16' is not supported; use one of auto, int8, "
                                          "fp8_e4m3, fp8_e5m2"):
        LLM(kv_cache_dtype="fp16")
    monkeypatch.delattr(torch, "float8_e5m2")  # a torch without the fp8 dtype
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8_e5m2' needs torch.float8_e5m2"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp8_e5m2")

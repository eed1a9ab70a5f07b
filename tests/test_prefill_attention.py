"""prefill_attention and prefill_attention_paged (kernels/cpu/prefill_attention.cpp): causal bf16 attention of a
prompt without cached context, and of a chunk after cached context read from the paged cache, against float32 SDPA
on the same bf16 inputs: within what bf16 rounding of the probabilities and the output costs, as close as torch's
own bf16 SDPA; q, k, v as the model hands them over (views of the fused qkv rows); the attention layer takes them
for bf16 prompts, chunked prompts and prefix-cache hits, and the tokens stay those of SDPA's path."""
import pytest
import torch
import torch.nn.functional as F

from qwenserve import LLM, SamplingParams

from helpers import save_hf_dir, tiny_hf_model


@pytest.fixture
def supported(ops):
    if not ops.prefill_attention_supported(64):
        pytest.skip("prefill_attention needs AVX512-BF16")
    return ops


def fused_qkv(n, heads, kv_heads, d, seed):
    """q, k, v as column slices of one [n, (heads + 2 kv_heads) d] bf16 matrix, as the model's qkv projection."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * d, generator=g) * 2).bfloat16()
    q = qkv[:, :heads * d].view(n, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(n, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
    return q, k, v


def sdpa(q, k, v, dtype):
    """q [n, heads, d] at the last n of k's positions (k, v: [context, kv_heads, d]), causal."""
    def heads_first(x):
        return x.to(dtype).transpose(0, 1).unsqueeze(0)
    n, context = q.shape[0], k.shape[0]
    mask = torch.ones(n, context, dtype=torch.bool).tril(diagonal=context - n)
    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), attn_mask=mask,
                                         scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).float()


def assert_close_as_torch_bf16(out, q, k, v):
    exact = sdpa(q, k, v, torch.float32)
    ours = (out.float() - exact).abs()
    torch_bf16 = (sdpa(q, k, v, torch.bfloat16) - exact).abs()
    assert ours.max() <= max(2 * torch_bf16.max(), 2 ** -6 * exact.abs().max())
    assert ours.mean() <= 2 * torch_bf16.mean() + 1e-4


@pytest.mark.parametrize("n,heads,kv_heads,d", [
    (2, 14, 2, 64), (5, 14, 2, 64), (31, 4, 4, 64), (33, 8, 2, 64), (100, 14, 2, 64), (257, 7, 1, 64),
    (77, 8, 2, 128),
])
def test_equals_sdpa_within_bf16_rounding(supported, n, heads, kv_heads, d):
    q, k, v = fused_qkv(n, heads, kv_heads, d, seed=n + d)
    out = torch.full((n, heads, d), float("nan"), dtype=torch.bfloat16)
    supported.prefill_attention(out, q, k, v, d ** -0.5)
    assert_close_as_torch_bf16(out, q, k, v)
    # the first position sees only itself: its output is its value row, rounded once
    assert torch.equal(out[0], v[0].repeat_interleave(heads // kv_heads, 0))


def test_bad_arguments_name_the_problem(supported):
    q, k, v = fused_qkv(8, 4, 2, 64, seed=1)
    out = torch.empty(8, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must be bf16"):
        supported.prefill_attention(out, q.float(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="heads a multiple of kv_heads"):
        supported.prefill_attention(torch.empty(8, 3, 64, dtype=torch.bfloat16), q[:, :3], k, v, 0.125)
    with pytest.raises(RuntimeError, match="out must be a contiguous bf16 tensor like q"):
        supported.prefill_attention(torch.empty(8, 4, 64), q, k, v, 0.125)
    assert not supported.prefill_attention_supported(96)


def paged_cache(k, v, block_size, seed, spare=3):
    """k, v [context, kv_heads, d] written into caches [blocks, block_size, kv_heads, d] at shuffled blocks (spare
    blocks of noise among them) -> (k_cache, v_cache, block_table)."""
    g = torch.Generator().manual_seed(seed)
    context, kv_heads, d = k.shape
    used = -(-context // block_size)
    k_cache = torch.randn(used + spare, block_size, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(used + spare, block_size, kv_heads, d, generator=g).bfloat16()
    table = torch.randperm(used + spare, generator=g)[:used]
    for t in range(context):
        k_cache[table[t // block_size], t % block_size] = k[t]
        v_cache[table[t // block_size], t % block_size] = v[t]
    return k_cache, v_cache, table


@pytest.mark.parametrize("past,n,heads,kv_heads,d,block_size", [
    (1, 1, 14, 2, 64, 16), (16, 1, 4, 2, 64, 16), (5, 3, 14, 2, 64, 16), (31, 2, 8, 2, 64, 16),
    (32, 32, 8, 2, 64, 16), (100, 37, 14, 2, 64, 16), (257, 6, 7, 1, 64, 8), (40, 77, 8, 2, 128, 32),
    (1000, 24, 16, 8, 128, 16),
])
def test_after_cached_context_equals_sdpa_within_bf16_rounding(supported, past, n, heads, kv_heads, d, block_size):
    """A chunk at positions past .. past + n - 1 (a prefix-cache hit, a later chunk of a long prompt, a verify step
    of speculative decoding) over keys read from the paged cache through its block table."""
    context = past + n
    q, k, v = fused_qkv(context, heads, kv_heads, d, seed=past + n + d)
    k_cache, v_cache, table = paged_cache(k, v, block_size, seed=past)
    chunk = q[past:]
    out = torch.full((n, heads, d), float("nan"), dtype=torch.bfloat16)
    supported.prefill_attention_paged(out, chunk, k_cache, v_cache, table, context, d ** -0.5)
    assert_close_as_torch_bf16(out, chunk, k, v)
    # the same rows as the whole prompt's own attention gives them, within the rounding of both
    whole = torch.empty(context, heads, d, dtype=torch.bfloat16)
    supported.prefill_attention(whole, q, k, v, d ** -0.5)
    assert (out.float() - whole[past:].float()).abs().max() <= 2 ** -6 * whole.float().abs().max()


def test_paged_bad_arguments_name_the_problem(supported):
    q, k, v = fused_qkv(40, 4, 2, 64, seed=2)
    k_cache, v_cache, table = paged_cache(k, v, 16, seed=2)
    chunk, out = q[30:], torch.empty(10, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="context_len 8 is less than the chunk's 10 rows"):
        supported.prefill_attention_paged(out, chunk, k_cache, v_cache, table, 8, 0.125)
    with pytest.raises(RuntimeError, match="at least 3 blocks for 40 positions"):
        supported.prefill_attention_paged(out, chunk, k_cache, v_cache, table[:2], 40, 0.125)
    with pytest.raises(RuntimeError, match="block 99 outside the cache's 6"):
        supported.prefill_attention_paged(out, chunk, k_cache, v_cache, torch.tensor([0, 99, 1]), 40, 0.125)
    with pytest.raises(RuntimeError, match="caches must be contiguous bf16"):
        supported.prefill_attention_paged(out, chunk, k_cache.float(), v_cache.float(), table, 40, 0.125)
    with pytest.raises(RuntimeError, match="out must be a contiguous bf16 tensor like q"):
        supported.prefill_attention_paged(torch.empty(10, 4, 64), chunk, k_cache, v_cache, table, 40, 0.125)


class CountingOps:
    """The kernels' ops, counting prefill_attention's calls."""
    def __init__(self, ops):
        self.ops, self.prefill_calls, self.paged_calls = ops, 0, 0

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def prefill_attention(self, *args):
        self.prefill_calls += 1
        return self.ops.prefill_attention(*args)

    def prefill_attention_paged(self, *args):
        self.paged_calls += 1
        return self.ops.prefill_attention_paged(*args)


def test_the_engine_uses_it_for_bf16_prompts_and_keeps_the_tokens(supported, tmp_path):
    """Greedy bf16 tokens with the kernel equal those with SDPA on nearly every position (both round in bf16, in
    different places), and the kernel really ran."""
    from qwenserve.model.layers.attention import Attention

    hf = tiny_hf_model(seed=17, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512)
    path = save_hf_dir(hf, str(tmp_path / "m"))
    prompts = [{"prompt_token_ids": list(range(3 + i, 70 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for use_kernel in (True, False):
        llm = LLM(path, dtype="bfloat16", kv_cache_memory="16MiB")
        layers = [m for m in llm.engine.executor.worker.model.modules() if isinstance(m, Attention)]
        counting = CountingOps(supported)
        for layer in layers:
            assert layer._bf16_prefill
            layer._bf16_prefill, layer._ops = use_kernel, counting
        tokens[use_kernel] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (counting.prefill_calls > 0) == use_kernel
    same = sum(a == b for x, y in zip(tokens[True], tokens[False]) for a, b in zip(x, y))
    assert same >= 0.9 * 16 * len(prompts), f"{same}/{16 * len(prompts)} tokens equal SDPA's path"


def test_chunked_prompts_and_prefix_hits_take_the_paged_kernel_and_keep_the_tokens(supported, tmp_path):
    """Prompts cut into chunks of 24 tokens, then the same prompts' prefixes served from the cache: every chunk
    after the first attends through prefill_attention_paged, and greedy bf16 tokens equal SDPA's path on nearly
    every position."""
    from qwenserve.model.layers.attention import Attention

    hf = tiny_hf_model(seed=23, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512)
    path = save_hf_dir(hf, str(tmp_path / "m"))
    first = [{"prompt_token_ids": list(range(5 + i, 75 + 2 * i))} for i in range(3)]
    again = [{"prompt_token_ids": p["prompt_token_ids"] + [7, 8, 9, 10 + i]} for i, p in enumerate(first)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens, calls = {}, {}
    for use_kernel in (True, False):
        llm = LLM(path, dtype="bfloat16", kv_cache_memory="16MiB", max_num_batched_tokens=24, max_num_seqs=2,
                  enable_prefix_caching=True)
        counting = CountingOps(supported)
        for layer in (m for m in llm.engine.executor.worker.model.modules() if isinstance(m, Attention)):
            layer._bf16_prefill, layer._ops = use_kernel, counting
        outputs = llm.generate(first, params, use_tqdm=False) + llm.generate(again, params, use_tqdm=False)
        tokens[use_kernel] = [o.outputs[0].token_ids for o in outputs]
        calls[use_kernel] = counting.paged_calls
    assert calls[True] > 0 and calls[False] == 0
    total = sum(len(t) for t in tokens[True])
    same = sum(a == b for x, y in zip(tokens[True], tokens[False]) for a, b in zip(x, y))
    assert same >= 0.9 * total, f"{same}/{total} tokens equal SDPA's path"

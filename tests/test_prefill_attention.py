"""prefill_attention (kernels/cpu/prefill_attention.cpp): causal bf16 attention of a prompt without cached context,
against float32 SDPA on the same bf16 inputs: within what bf16 rounding of the probabilities and the output costs,
as close as torch's own bf16 SDPA; q, k, v as the model hands them over (views of the fused qkv rows); the
attention layer takes it for bf16 prompts and the tokens stay those of SDPA's path."""
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
    def heads_first(x):
        return x.to(dtype).transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                         scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).float()


@pytest.mark.parametrize("n,heads,kv_heads,d", [
    (2, 14, 2, 64), (5, 14, 2, 64), (31, 4, 4, 64), (33, 8, 2, 64), (100, 14, 2, 64), (257, 7, 1, 64),
    (77, 8, 2, 128),
])
def test_equals_sdpa_within_bf16_rounding(supported, n, heads, kv_heads, d):
    q, k, v = fused_qkv(n, heads, kv_heads, d, seed=n + d)
    out = torch.full((n, heads, d), float("nan"), dtype=torch.bfloat16)
    supported.prefill_attention(out, q, k, v, d ** -0.5)
    exact = sdpa(q, k, v, torch.float32)
    ours = (out.float() - exact).abs()
    torch_bf16 = (sdpa(q, k, v, torch.bfloat16) - exact).abs()
    assert ours.max() <= max(2 * torch_bf16.max(), 2 ** -6 * exact.abs().max())
    assert ours.mean() <= 2 * torch_bf16.mean() + 1e-4
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


class CountingOps:
    """The kernels' ops, counting prefill_attention's calls."""
    def __init__(self, ops):
        self.ops, self.prefill_calls = ops, 0

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def prefill_attention(self, *args):
        self.prefill_calls += 1
        return self.ops.prefill_attention(*args)


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

"""Our compiled CPU kernels against the PyTorch ops they replace: bit-identical in bfloat16 where the PyTorch
path rounds after every op, within one rounding in float16 and float32; and the engine gives the same greedy
tokens (equal to HF's) with and without them."""

import os
import time

import pytest
import torch
import torch.nn.functional as F

from qwenserve import LLM, SamplingParams, kernels
from qwenserve.kernels import sources
from qwenserve.model.layers.activation import SiluAndMul
from qwenserve.model.layers.layernorm import RMSNorm
from qwenserve.model.layers.rotary import RotaryEmbedding
from qwenserve.tools.compare import hf_greedy

from helpers import save_hf_dir, tiny_hf_model



def assert_same(got, expected, dtype):
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    elif dtype == torch.float16:  # PyTorch's half ops may round an intermediate the kernel keeps in float
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_and_fused_residual_add(ops, dtype):
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(19, 200, generator=g).to(dtype) * 3 for _ in range(2))
    norm = RMSNorm(200, 1e-6).to(dtype)
    norm.weight.copy_(torch.randn(200, generator=g))
    expected = norm._norm(x)
    assert_same(norm(x), expected, dtype)

    expected_sum = x + residual
    expected = norm._norm(expected_sum)
    got, got_sum = norm(x.clone(), residual.clone())
    assert torch.equal(got_sum, expected_sum)
    assert_same(got, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul(ops, dtype):
    x = (torch.randn(7, 2 * 333, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert_same(SiluAndMul()(x), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_at_the_ends_of_the_range(ops, dtype):
    """Gates where exp(-gate) overflows (below -88.7: SiLU is -0, as in PyTorch), near the bound, tiny, and large."""
    gate = torch.tensor([-1000.0, -100.0, -89.0, -88.0, -87.5, -50.0, -1e-30, 0.0, 1e-30, 3e-4, 50.0, 88.0, 100.0])
    x = torch.cat([gate, torch.full_like(gate, 1.5)]).unsqueeze(0).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    got, expected = SiluAndMul()(x), F.silu(gate) * up
    assert_same(got, expected, dtype)
    assert torch.equal(got[0, :3].abs(), torch.zeros(3, dtype=dtype))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "dynamic", "factor": 4.0},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_in_place_on_qkv(ops, dtype, scaling):
    heads, kv_heads, d, t = 6, 2, 32, 23
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the model builds its cos/sin table in the run dtype
    try:
        rotary = RotaryEmbedding(d, 512, 10000.0, 64, scaling)
    finally:
        torch.set_default_dtype(previous)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.randint(0, 200, (t,), generator=g)  # past 64: dynamic NTK recomputes its frequencies
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    expected_q, expected_k = rotary(positions, q.reshape(t, heads, d), k.reshape(t, kv_heads, d))
    expected_v = v.clone()

    got_q, got_k, got_v = rotary.rotate_qkv(positions, qkv, heads, kv_heads)
    assert got_q.data_ptr() == qkv.data_ptr(), "the kernel rotates inside the projection's output"
    assert_same(got_q, expected_q, dtype)
    assert_same(got_k, expected_k, dtype)
    assert torch.equal(got_v.reshape(t, -1), expected_v)


def test_rotary_rejects_positions_outside_its_table(ops):
    rotary = RotaryEmbedding(16, 32, 10000.0, 32)
    qkv = torch.zeros(2, 3 * 16)
    with pytest.raises(RuntimeError, match="position 40 is outside the cos/sin table of 32"):
        rotary.rotate_qkv(torch.tensor([0, 40]), qkv, 1, 1)


def reference_decode(q, k_cache, v_cache, tables, lens, scale):
    out = []
    kv_heads, d = k_cache.shape[2:]
    for b in range(q.shape[0]):
        keys = k_cache[tables[b]].reshape(-1, kv_heads, d)[:lens[b]].transpose(0, 1).float()
        values = v_cache[tables[b]].reshape(-1, kv_heads, d)[:lens[b]].transpose(0, 1).float()
        out.append(F.scaled_dot_product_attention(q[b].float().unsqueeze(1), keys, values, scale=scale,
                                                  enable_gqa=True).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(14, 2, 64, 16), (4, 4, 24, 5), (8, 1, 128, 3), (6, 2, 32, 7)])
def test_paged_decode_attention_reads_blocks_in_place(ops, dtype, heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(3)
    num_blocks, batch = 40, 6
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    width = 36 // block_size + 1
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(batch)])
    lens = torch.tensor([1, block_size, block_size + 1, 17, 29, 36])
    # q as the model hands it over: a strided view into the fused qkv output
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, :heads * head_dim].view(batch, heads, head_dim)
    out = torch.empty(q.shape, dtype=dtype)
    ops.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    expected = reference_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_paged_decode_attention_rejects_a_context_beyond_its_table(ops):
    cache = torch.zeros(4, 2, 1, 16)
    q = torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match="context length out of the block table's range"):
        ops.paged_decode_attention(torch.empty_like(q), q, cache, cache, torch.tensor([[0, 1]]), torch.tensor([5]), 1.0)


@pytest.mark.slow
def test_engine_gives_the_same_tokens_with_and_without_kernels(ops, tmp_path):
    hf = tiny_hf_model(seed=5, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    path = save_hf_dir(hf, str(tmp_path))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 40, 17, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def greedy(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    with_kernels = greedy(LLM(path, dtype="float32", kv_cache_memory="4MiB"))
    with kernels.disabled():
        llm = LLM(path, dtype="float32", kv_cache_memory="4MiB")
        assert not llm.engine.executor.worker.model_runner.input_batch.decode_kernel
        without = greedy(llm)
    assert with_kernels == without
    assert with_kernels == [hf_greedy(hf, ids, 20)[0] for ids in prompts]


BUILD_LOG = ("Error building extension 'qwenserve_cpu_ops': [1/2] c++ -c norm.cpp\n"
             "norm.cpp:12:5: error: 'vec_t' was not declared in this scope\nninja: build stopped: subcommand failed.")


def test_a_failed_build_with_a_compiler_is_an_error_at_start(monkeypatch, tmp_path):
    """Serving on without the kernels would be several times slower: the engine does not start, the error names
    the compiler's complaint and the way to choose the PyTorch path; that choice then starts."""
    builds = []

    def broken(variant):
        builds.append(variant.name)
        raise RuntimeError(BUILD_LOG)

    monkeypatch.setattr(kernels, "_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(kernels, "_build", broken)
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(sources, "PREBUILT_DIR", tmp_path / "no prebuilt libraries")
    path = save_hf_dir(tiny_hf_model(seed=5), str(tmp_path))
    pattern = (r"(?s)CPU kernels \(\w+ variant\) failed to build with /usr/bin/c\+\+:\n"
               r".*norm.cpp:12:5: error: 'vec_t' was not declared.*QWENSERVE_CPU_KERNELS=0 or --no-cpu-kernels")
    with pytest.raises(kernels.KernelBuildError, match=pattern):
        LLM(path, dtype="float32", kv_cache_memory="4MiB")
    with pytest.raises(kernels.KernelBuildError):  # remembered: no second 20 s build
        kernels.cpu_ops_for("cpu")
    assert len(builds) == 1
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB", cpu_kernels=False)  # the PyTorch path, on purpose
    assert not llm.engine.executor.worker.model_runner.input_batch.decode_kernel
    assert len(builds) == 1


def test_without_a_compiler_the_pytorch_path_runs_with_a_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    monkeypatch.setattr(kernels, "_build", lambda variant: pytest.fail("built without a compiler"))
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(sources, "PREBUILT_DIR", tmp_path / "no prebuilt libraries")
    with caplog.at_level("WARNING", logger="qwenserve.kernels"):
        assert kernels.cpu_ops() is None
        assert kernels.cpu_ops_for("cpu") is None
    assert "no C++ compiler found" in caplog.text and "QWENSERVE_CPU_KERNELS=0" in caplog.text


def test_compiler_error_tail_keeps_the_error_lines():
    assert kernels._error_tail(BUILD_LOG) == "norm.cpp:12:5: error: 'vec_t' was not declared in this scope"
    assert kernels._error_tail("line 1\n\nline 2\n") == "line 1\nline 2"  # no error lines: the last ones


def test_disabled_blocks_nest(ops):
    with kernels.disabled():
        with kernels.use_cpu_kernels(False):
            assert kernels.cpu_ops_for("cpu") is None
        assert kernels.cpu_ops_for("cpu") is None  # the outer block still holds
        with kernels.use_cpu_kernels(True):
            assert kernels.cpu_ops_for("cpu") is None  # on: as the surrounding choice
    assert kernels.cpu_ops_for("cpu") is ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_takes_the_first_maximum(ops, dtype):
    logits = torch.randn(9, 1003, generator=torch.Generator().manual_seed(6)).to(dtype)
    logits[3, 10] = logits[3, 500] = logits[3, 900] = 50.0  # ties: the first index wins, as in torch.argmax
    logits[4, 17] = logits[4, 33] = 50.0  # the same lane of the vector pass
    logits[5] = 0.0
    logits[6, 1001] = 60.0  # in the tail past the last full vector
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    # rows shorter than one vector take the portable path
    short = logits[:, :11].contiguous()
    assert torch.equal(ops.argmax_rows(short), short.argmax(dim=-1))


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path, monkeypatch):
    """torch waits forever on its build lock; one older than any build is removed, a fresh one is left alone."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for name, age in (("stale", 3600), ("fresh", 5)):
        (tmp_path / name).mkdir()
        lock = tmp_path / name / "lock"
        lock.touch()
        os.utime(lock, (time.time() - age, time.time() - age))
        kernels._remove_stale_lock(name)
    assert not (tmp_path / "stale" / "lock").exists()
    assert (tmp_path / "fresh" / "lock").exists()


def test_the_build_takes_every_source_under_cpu_and_hashes_each(tmp_path, monkeypatch):
    """Sources in subdirectories (ggml/, arch/x86/) are compiled and any edit to one, a header included, changes the
    library's name; two .cpp files with one file name (the builder's object files are named after it) are refused."""
    (tmp_path / "arch" / "x86").mkdir(parents=True)
    (tmp_path / "ggml").mkdir()
    for name in ("register.cpp", "vec.h", "ggml/dispatch.cpp", "arch/x86/avx2.h"):
        (tmp_path / name).write_text("// one\n")
    monkeypatch.setattr(sources, "SOURCE_DIR", tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in sources.source_files()] == [
        "arch/x86/avx2.h", "ggml/dispatch.cpp", "register.cpp", "vec.h"]
    flags = ["-O3", "-mavx2"]
    tag = sources.source_hash(flags)
    (tmp_path / "arch" / "x86" / "avx2.h").write_text("// two\n")
    edited = sources.source_hash(flags)
    (tmp_path / "arch" / "x86" / "avx2.h").rename(tmp_path / "ggml" / "avx2.h")  # the same bytes elsewhere
    moved = sources.source_hash(flags)
    assert len({tag, edited, moved, sources.source_hash(["-O3"])}) == 4  # the flags count too
    (tmp_path / "arch" / "x86" / "dispatch.cpp").write_text("// one\n")
    with pytest.raises(RuntimeError, match="arch/x86/dispatch.cpp and ggml/dispatch.cpp share a file name"):
        sources.source_files()

"""bf16 / fp16 weights on CPUs without arithmetic in them: dense_mm (the weights widened in registers) against a
float64 reference on every kernel variant, and the linear layer's two routes (few rows through dense_mm, many
through float32 matmuls on widened slices) under `--cpu-isa avx2`, which runs bf16 layers as an AVX2 CPU does."""
import pytest
import torch

from helpers import variant_ops, variant_params
from qwenserve import kernels
from qwenserve.config.cpu_variants import this_cpu_flags
from qwenserve.model.layers import linear
from qwenserve.model.layers.linear import ColumnParallelLinear, widening_ops

VARIANTS = variant_params() or [pytest.param(None, id="none")]

# rows: one (decode), the multiples of the kernel's passes and what lies between them, a long prefill-sized batch;
# columns: not multiples of 8 (the tails), exactly 8, and a real width
SHAPES = [(1, 5, 37), (2, 9, 8), (3, 4, 17), (4, 7, 64), (5, 6, 896), (6, 3, 40), (7, 11, 24), (9, 5, 33),
          (33, 13, 896)]


def reference(x, w, bias):
    out = x.double() @ w.double().t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["x32", "xbf16", "x16"])
def test_dense_mm_matches_reference(variant, w_dtype, x_dtype):
    ops = variant_ops(variant) if variant is not None else pytest.skip("no kernel variants for this architecture")
    gen = torch.Generator().manual_seed(5)
    for m, n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).to(w_dtype)
        x = torch.randn(m, k, generator=gen).to(x_dtype)
        for bias in (None, torch.randn(n, generator=gen)):
            out = torch.full((m, n), float("nan"), dtype=x_dtype)
            ops.dense_mm(out, x, w, bias)
            expected = reference(x, w, bias)
            # float32 sums of k products; the output rounds once to its dtype
            tol = 1e-5 * k ** 0.5 * 4 + (0 if x_dtype == torch.float32 else 1e-2 * expected.abs().max().item())
            assert (out.double() - expected).abs().max().item() <= tol, (m, n, k, bias is None)


def test_dense_mm_writes_a_column_slice_only(ops):
    w = torch.randn(6, 40).bfloat16()
    x = torch.randn(3, 40).bfloat16()
    wide = torch.zeros(3, 10, dtype=torch.bfloat16)
    ops.dense_mm(wide[:, 2:8], x, w, None)
    assert torch.equal(wide[:, :2], torch.zeros(3, 2, dtype=torch.bfloat16))
    assert torch.equal(wide[:, 8:], torch.zeros(3, 2, dtype=torch.bfloat16))
    torch.testing.assert_close(wide[:, 2:8].float(), (x.float() @ w.float().t()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bad, message", [
    (lambda: (torch.empty(2, 3), torch.randn(2, 4), torch.randn(3, 4).float(), None), "bf16 or fp16 weights"),
    (lambda: (torch.empty(2, 3), torch.randn(2, 5), torch.randn(3, 4).bfloat16(), None), "columns"),
    (lambda: (torch.empty(2, 4), torch.randn(2, 4), torch.randn(3, 4).bfloat16(), None), "out must be"),
    (lambda: (torch.empty(2, 3).bfloat16(), torch.randn(2, 4), torch.randn(3, 4).bfloat16(), None), "share a dtype"),
    (lambda: (torch.empty(2, 3), torch.randn(2, 4), torch.randn(3, 4).bfloat16(), torch.randn(2)), "bias"),
])
def test_dense_mm_rejects_bad_arguments(ops, bad, message):
    out, x, w, bias = bad()
    with pytest.raises(RuntimeError, match=message):
        ops.dense_mm(out, x, w, bias)


@pytest.fixture
def avx2_process():
    """The rest of the test runs as with --cpu-isa avx2 (skipped on CPUs without AVX2)."""
    if "avx2" not in this_cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if kernels.cpu_ops("avx2") is None:
        pytest.skip("no C++ compiler to build the avx2 variant")
    with kernels.use_cpu_kernels(True, cpu_isa="avx2"):
        yield


@pytest.mark.kernels  # builds the avx2 variant where it is not the default
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_linear_layer_routes_under_avx2(avx2_process, monkeypatch, dtype):
    layer = ColumnParallelLinear(96, 50, bias=True)
    torch.manual_seed(3)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(50, 96))
        layer.bias.copy_(torch.randn(50))
    layer.weight.data = layer.weight.data.to(dtype)
    layer.bias.data = layer.bias.data.to(dtype)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None and layer.widening_ops is not None
    assert layer.weight.dtype == dtype  # still 2 bytes a weight
    calls = []

    class Counting:  # the layer's kernel library, counting dense_mm calls
        def __init__(self, ops):
            self.ops = ops

        def dense_mm(self, *args):
            calls.append(1)
            self.ops.dense_mm(*args)

    layer.widening_ops = Counting(layer.widening_ops)
    monkeypatch.setattr(linear, "WIDEN_SLICE_WEIGHTS", 16 * 96)  # slices of 16 rows: 16, 16, 16 and 2
    for rows in (1, linear.WIDEN_IN_REGISTERS_BELOW_ROWS - 1, linear.WIDEN_IN_REGISTERS_BELOW_ROWS, 70):
        calls.clear()
        x = torch.randn(rows, 96).to(dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, 50)
        expected = reference(x, layer.weight, layer.bias)
        assert (out.double() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
        assert bool(calls) == (rows < linear.WIDEN_IN_REGISTERS_BELOW_ROWS)


def test_float32_weights_keep_pytorch_matmul():
    assert widening_ops(torch.randn(4, 8)) is None


def test_a_kept_bf16_weight_takes_dense_mm_for_few_rows(monkeypatch):
    """A bf16 weight kept beside oneDNN's packed copy (a tied LM head) runs up to KEPT_WEIGHT_DENSE_MM_ROWS rows
    through dense_mm's pair dot products, more through the packed copy; both as the float64 reference."""
    layer = ColumnParallelLinear(96, 50, bias=False)
    torch.manual_seed(4)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(50, 96))
    layer.weight.data = layer.weight.data.bfloat16()
    if not linear.cpu_weight_packing_available(layer.weight) or not linear.variant_has_bf16_pairs():
        pytest.skip("the CPU or the kernel variant has no bf16 arithmetic: nothing is packed")
    layer.weight_is_shared = True
    layer.process_weights_after_loading()
    assert layer.packed_weight is not None and layer.weight is not None and layer.kept_weight_ops is not None
    calls = []
    ops = layer.kept_weight_ops
    monkeypatch.setattr(layer, "kept_weight_ops", type("Counting", (), {
        "dense_mm": staticmethod(lambda *args: (calls.append(1), ops.dense_mm(*args)))})())
    for rows in (1, linear.KEPT_WEIGHT_DENSE_MM_ROWS, linear.KEPT_WEIGHT_DENSE_MM_ROWS + 1, 40):
        calls.clear()
        x = torch.randn(rows, 96).bfloat16()
        out = layer(x)
        expected = reference(x, layer.weight, None)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 50)
        assert (out.double() - expected).abs().max().item() <= 1e-2 * expected.abs().max().item()
        assert bool(calls) == (rows <= linear.KEPT_WEIGHT_DENSE_MM_ROWS)

"""FP8 e4m3 weights on our kernels (kernels/cpu/dense.cpp): fp8_mm (codes widened in registers inside the dot
products) against a float64 reference, and fp8_dequantize bit for bit against torch's conversion times the scale,
on every kernel variant, every code included; then the linear path's two routes (few rows through fp8_mm, many
through matmuls on widened slices) and an FP8 checkpoint's decode on them."""
import pytest
import torch

from helpers import variant_ops, variant_params
from qwenserve.model.layers import linear
from qwenserve.model.layers.quantization import fp8
from qwenserve.model.layers.quantization.fp8 import fp8_linear, fp8_ops, quantize_blocks

VARIANTS = variant_params() or [pytest.param(None, id="none")]
E4M3 = torch.float8_e4m3fn

# (rows, out features, in features, scale group): one row (decode) to past the kernel's four-row passes and two-row
# pairs; groups of 128 (block checkpoints) with a partial edge block, a whole row (per channel), groups that are not
# multiples of 8, and widths with tails. From 32 rows, bf16 activations on AVX512-BF16 builds take the tiles: a
# panel's last weight rows (33, 70), inputs past the last 32 (130), a last pass of fewer activation rows than a tile
# (45, 33), a whole-row group; an odd width or group (333, 5) keeps them on the dot products.
SHAPES = [(1, 5, 300, 128), (2, 9, 8, 8), (3, 4, 17, 17), (4, 7, 256, 128), (5, 6, 896, 128), (6, 3, 40, 12),
          (7, 11, 24, 5), (9, 5, 333, 128), (31, 13, 896, 896), (32, 33, 130, 128), (45, 70, 896, 128),
          (33, 16, 300, 300), (40, 9, 333, 128), (34, 8, 40, 5)]


def every_code_weights(n, k, gen):
    """[n, k] e4m3 codes cycling through all 254 finite codes (subnormals, zeros of both signs, the largest) from a
    random start per row."""
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = finite[finite.view(E4M3).float().isfinite()]
    starts = torch.randint(0, len(finite), (n, 1), generator=gen)
    return finite[(starts + torch.arange(k)) % len(finite)]


def scales_for(n, k, group, gen):
    return torch.rand(n, -(-k // group), generator=gen) * 2e-2 + 1e-6


def reference(x, codes, scales, group, bias=None):
    k = codes.shape[1]
    w = codes.view(E4M3).double() * scales.double().repeat_interleave(group, 1)[:, :k]
    out = x.double() @ w.t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["x32", "xbf16", "x16"])
def test_fp8_mm_matches_reference(variant, x_dtype):
    ops = variant_ops(variant) if variant is not None else pytest.skip("no kernel variants for this architecture")
    gen = torch.Generator().manual_seed(7)
    for m, n, k, group in SHAPES:
        codes = every_code_weights(n, k, gen)
        scales = scales_for(n, k, group, gen)
        x = torch.randn(m, k, generator=gen).to(x_dtype)
        for bias in (None, torch.randn(n, generator=gen)):
            out = torch.full((m, n), float("nan"), dtype=x_dtype)
            ops.fp8_mm(out, x, codes, scales, group, bias)
            expected = reference(x, codes, scales, group, bias)
            scale = (x.double().abs() @ reference(torch.eye(k), codes, scales, group).abs()).max().item()
            tol = 1e-6 * k ** 0.5 * scale + (0 if x_dtype == torch.float32 else 1e-2 * expected.abs().max().item())
            assert (out.double() - expected).abs().max().item() <= tol, (m, n, k, group, bias is None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_dequantize_is_code_times_scale_exactly(variant):
    ops = variant_ops(variant) if variant is not None else pytest.skip("no kernel variants for this architecture")
    gen = torch.Generator().manual_seed(8)
    for n, k, group in ((300, 254, 128), (17, 254, 254), (9, 100, 7)):
        codes = every_code_weights(n, k, gen)
        scales = scales_for(n, k, group, gen)
        want = codes.view(E4M3).float() * scales.repeat_interleave(group, 1)[:, :k]
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = torch.empty(n, k, dtype=dtype)
            ops.fp8_dequantize(out, codes.view(E4M3), scales, group)  # float8_e4m3fn codes as well as bytes
            assert torch.equal(out, want.to(dtype)), (n, k, group, dtype)


@pytest.mark.parametrize("rows", [2, 40], ids=["pairs", "tiles"])
def test_fp8_mm_takes_large_and_non_finite_activations(ops, rows):
    """bf16 activations too large for the lift of the pair dot products and the tiles (AVX512-BF16 builds) take
    the float path: the result is still the reference's; a NaN activation gives NaN in every output it meets, as a
    matmul does."""
    gen = torch.Generator().manual_seed(11)
    codes, scales = every_code_weights(6, 256, gen), scales_for(6, 256, 128, gen)
    x = torch.randn(rows, 256, generator=gen)
    x[0, 5] = 2.0 ** 70
    x = x.bfloat16()
    out = torch.empty(rows, 6, dtype=torch.bfloat16)
    ops.fp8_mm(out, x, codes, scales, 128, None)
    expected = reference(x, codes, scales, 128)
    assert ((out.double() - expected).abs() <= 1e-2 * expected.abs() + 1e-3).all()
    x[0, 5] = 1.0
    x[1, 7] = float("nan")
    ops.fp8_mm(out, x, codes, scales, 128, None)
    assert out[1].isnan().all() and not out[0].isnan().any() and not out[2:].isnan().any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_tiles_are_built_where_the_variant_has_bf16_pairs(variant):
    """fp8_mm's prefill tiles exist exactly in the variants with AVX512-BF16; elsewhere fp8_linear widens slices
    for many rows."""
    ops = variant_ops(variant) if variant is not None else pytest.skip("no kernel variants for this architecture")
    assert ops.fp8_tiles() == ("avx512_bf16" in variant.needs)


def test_fp8_mm_writes_a_column_slice_only(ops):
    gen = torch.Generator().manual_seed(9)
    codes, scales = every_code_weights(6, 256, gen), scales_for(6, 256, 128, gen)
    x = torch.randn(3, 256, generator=gen)
    wide = torch.zeros(3, 10)
    ops.fp8_mm(wide[:, 2:8], x, codes, scales, 128, None)
    assert torch.equal(wide[:, :2], torch.zeros(3, 2)) and torch.equal(wide[:, 8:], torch.zeros(3, 2))
    torch.testing.assert_close(wide[:, 2:8].double(), reference(x, codes, scales, 128), rtol=1e-5, atol=1e-5)


def _args(n=3, k=256, group=128, m=2):
    return (torch.empty(m, n), torch.randn(m, k), torch.zeros(n, k, dtype=torch.uint8),
            torch.ones(n, -(-k // group)), group, None)


@pytest.mark.parametrize("change, message", [
    (lambda a: (a[0], a[1], a[2].float(), *a[3:]), "uint8 or float8_e4m3fn"),
    (lambda a: (a[0], torch.randn(2, 255), *a[2:]), "columns"),
    (lambda a: (torch.empty(2, 4), *a[1:]), "out must be"),
    (lambda a: (a[0], a[1], a[2], torch.ones(3, 3), *a[4:]), r"scales must be contiguous float32 \[3, 2\]"),
    (lambda a: (a[0], a[1], a[2], a[3].double(), *a[4:]), "scales must be"),
    (lambda a: (*a[:4], 0, None), "group must be positive"),
    (lambda a: (*a[:5], torch.randn(2)), "bias"),
])
def test_fp8_mm_rejects_bad_arguments(ops, change, message):
    with pytest.raises(RuntimeError, match=message):
        ops.fp8_mm(*change(_args()))


@pytest.mark.parametrize("rows", [1, 4, linear.WIDEN_IN_REGISTERS_BELOW_ROWS - 1, linear.WIDEN_IN_REGISTERS_BELOW_ROWS,
                                  70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_linear_routes_agree_with_the_dequantized_weight(ops, monkeypatch, rows, dtype):
    """Every route (fp8_mm below the row threshold; from it fp8_mm's tiles for bf16 on AVX512-BF16 builds, else
    widened slices, several per weight) and the PyTorch path where no kernels are give the dequantized weight's
    product."""
    monkeypatch.setattr(fp8, "DEQUANTIZE_WEIGHTS", 40 * 300)  # slices of 40 rows: several per weight
    gen = torch.Generator().manual_seed(10)
    weight = torch.randn(130, 300, generator=gen)
    codes, block_scales = quantize_blocks(weight, (128, 128))
    scales = block_scales.repeat_interleave(128, 0)[:130]
    x = torch.randn(rows, 300, generator=gen).to(dtype)
    bias = torch.randn(130, generator=gen)
    want = reference(x, codes.view(torch.uint8), scales, 128, bias)
    for kernels in (fp8_ops(torch.device("cpu")), None):
        got = fp8_linear(kernels, codes, scales, 128, x, bias)
        assert got.dtype == dtype and got.shape == (rows, 130)
        tol = 1e-4 if dtype == torch.float32 else 3e-2 * want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= tol, kernels


@pytest.mark.parametrize("table, tiles_from", [("AVX512_BF16", 32), ("AMX", None), ("PORTABLE", None)])
def test_fp8_prefill_takes_the_tiles_where_the_cpus_table_says(ops, monkeypatch, table, tiles_from):
    """With tiles in the kernels, bf16 rows from fp8_tiles_from_rows go to fp8_mm on the avx512_bf16 class; the amx
    class (oneDNN on AMX tiles) and float32 rows keep the widened slices."""
    from types import SimpleNamespace

    from qwenserve.config import tuning
    monkeypatch.setattr(fp8, "this_cpu_tuning", lambda: getattr(tuning, table))
    calls = []
    spy = SimpleNamespace(fp8_tiles=lambda: True, fp8_dequantize=ops.fp8_dequantize,
                          fp8_mm=lambda out, x, *rest: calls.append(x.shape[0]) or ops.fp8_mm(out, x, *rest))
    codes, scales = quantize_blocks(torch.randn(40, 64), (128, 128))
    scales = scales.repeat_interleave(128, 0)[:40]
    for rows, dtype in ((31, torch.bfloat16), (32, torch.bfloat16), (70, torch.bfloat16), (70, torch.float32)):
        fp8_linear(spy, codes, scales, 128, torch.randn(rows, 64).to(dtype))
    assert calls == [31] + ([32, 70] if tiles_from == 32 else [])


def test_fp8_linear_keeps_leading_dimensions(ops):
    codes, scales = quantize_blocks(torch.randn(16, 64), (128, 128))
    x = torch.randn(2, 3, 64)
    got = fp8_linear(fp8_ops(torch.device("cpu")), codes, scales.repeat_interleave(128, 0)[:16], 128, x)
    assert got.shape == (2, 3, 16)
    torch.testing.assert_close(got, fp8_linear(None, codes, scales.repeat_interleave(128, 0)[:16], 128, x))

"""The ggml kernels (kernels/cpu/ggml/): ggml_dequantize against our torch dequantizers bit for bit, and
ggml_mm (a linear layer on quantized weights, activations quantized per row to q8_0 / q8_K as ggml does) against a
float64 reference of the same quantization, and against F.linear on the dequantized weight; every test runs once per
kernel variant this CPU runs (config/cpu_variants.py), and each variant is checked against the baseline build."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from helpers import variant_ops, variant_params

from qwenserve.config.cpu_variants import machine_arch, this_cpu_flags, variants_for
from qwenserve.model.loader.dequant import dequantize
from qwenserve.model.loader.ggml_tensor import DECODE_GROUP, GGMLTensor

Q = GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# where each block format keeps its fp16 scale(s): random bytes there could be inf/nan
SCALE_OFFSETS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VARIANTS = variants_for(machine_arch())
BASELINE = VARIANTS[0] if VARIANTS else None  # built for every CPU of the architecture: the scalar reference's


@pytest.fixture(scope="module", params=variant_params() or [pytest.param(None, id="none")])
def variant(request):
    """Each kernel variant of this architecture the CPU runs, in turn; the ones it cannot run skip with the CPU
    flags they need."""
    if request.param is None:
        pytest.skip(f"no kernel variants for {machine_arch()}")
    return request.param


@pytest.fixture(scope="module")
def ops(variant):
    """The variant's kernels (this module's tests run once per variant)."""
    return variant_ops(variant)


@pytest.fixture(scope="module")
def baseline_ops():
    """The baseline variant's kernels: the scalar reference with no arch/ kernels compiled in."""
    return variant_ops(BASELINE)



def random_blocks(qtype, rows, cols, seed, scale=2.0):
    """uint8 [rows, row_bytes] of random ggml blocks whose fp16 scales are finite (uniform in +-scale)."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    nb = rows * cols // block_elems
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(nb, block_bytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        blocks[:, off:off + 2] = rng.uniform(-scale, scale, size=(nb, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, cols // block_elems * block_bytes))


def reference_dequant(raw, qtype, cols):
    return dequantize(raw.numpy().reshape(-1), qtype, (raw.shape[0], cols))


def quantize_q8_0_ref(x):
    """ggml's quantize_row_q8_0_ref on float32 rows: d = amax / 127, q = roundf(x * (1 / d)) (half away from
    zero), d stored as fp16. Returns the dequantized activations and a bound on each element's error (half a step,
    plus up to 127 times d's rounding to fp16), in float64."""
    b = x.float().reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, torch.ones_like(d) / d)  # (not 1.0 / d: torch makes that reciprocal() * 1.0)
    v = (b * inv).double()
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    d16 = d.half().double()
    err = d16 * (0.5 + 127 * 2.0 ** -10)
    return (q * d16).reshape(x.shape), err.expand_as(b).reshape(x.shape)


def quantize_q8_K_ref(x):
    """ggml's quantize_row_q8_K_ref: max = the (first) signed value of largest magnitude, iscale = -127 / max,
    q = min(127, nearest_int(iscale * x)) (ties to even), d = 1 / iscale in float32 (may be negative). Returns the
    dequantized activations and a bound on each element's error, in float64."""
    b = x.float().reshape(x.shape[0], -1, 256)
    mx = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    iscale = torch.full_like(mx, -127.0) / mx  # (not -127.0 / mx: torch makes that mx.reciprocal() * -127.0)
    q = torch.round(iscale * b).clamp(max=127)
    d = torch.ones_like(iscale) / iscale
    zero = mx == 0
    q, d = torch.where(zero, 0.0, q), torch.where(zero, 0.0, d)
    err = d.double().abs() * (0.5 + 127 * 2.0 ** -22)
    return (q.double() * d.double()).reshape(x.shape), err.expand_as(b).reshape(x.shape)


def quantize_ref(x, qtype):
    return quantize_q8_K_ref(x) if GGML_QUANT_SIZES[qtype][0] == 256 else quantize_q8_0_ref(x)


def run_mm(ops, x, raw, qtype, pad=(5, 11)):
    """ggml_mm into a column slice of a wider output; checks the columns around it are untouched."""
    n = raw.shape[0]
    sentinel = -12345.0
    y = torch.full((x.shape[0], pad[0] + n + pad[1]), sentinel, dtype=x.dtype)
    ops.ggml_mm(y[:, pad[0]:pad[0] + n], x, raw, int(qtype))
    assert (y[:, :pad[0]] == sentinel).all() and (y[:, pad[0] + n:] == sentinel).all()
    return y[:, pad[0]:pad[0] + n]


def output_ulp(dtype):
    return {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_equals_torch_dequantizers(ops, qtype, rows):
    cols = 2 * GGML_QUANT_SIZES[qtype][0] if rows == 64 else 3 * 256
    raw = random_blocks(qtype, rows, cols, seed=int(qtype) * 100 + rows)
    expected = reference_dequant(raw, qtype, cols)
    got = ops.ggml_dequantize(raw, int(qtype), cols, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got, expected)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(ops.ggml_dequantize(raw, int(qtype), cols, dtype), expected.to(dtype))


@pytest.mark.parametrize("m", [1, 3, 8, 33])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_mm_equals_quantized_reference_and_is_a_linear_layer(ops, qtype, dtype, m):
    k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96
    n = 37  # not a multiple of the kernel's 16-row tiles
    raw = random_blocks(qtype, n, k, seed=int(qtype) * 1000 + m, scale=0.02)  # float16 outputs stay finite
    g = torch.Generator().manual_seed(int(qtype) + m)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    w = reference_dequant(raw, qtype, k).double()

    got = run_mm(ops, x, raw, qtype).double()
    xq, xerr = quantize_ref(x, qtype)
    expected = xq @ w.T
    magnitude = xq.abs() @ w.abs().T  # the sum of |terms|: float summation order moves results relative to it
    assert ((got - expected).abs() <= 1e-4 * magnitude + output_ulp(dtype) * expected.abs()).all()

    # the layer itself: off F.linear only by the activations' rounding (bounded per element by xerr), plus the
    # output's rounding to its dtype
    exact = F.linear(x.double(), w)
    bound = xerr @ w.abs().T + 1e-4 * magnitude + output_ulp(dtype) * exact.abs()
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).norm() <= 0.02 * exact.norm()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_mm_zero_rows_and_rounding_ties(ops, qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    k, n = 2 * 256, 24
    raw = random_blocks(qtype, n, k, seed=7)
    w = reference_dequant(raw, qtype, k).double()
    x = torch.zeros(4, k)
    # row 1: one zero block and one of nothing but exact .5 ties for the quantizer: with q8_0's d = 127 / 127 = 1
    # and q8_K's iscale = -127 / -127 = 1, x * (1 / d) = x; q8_0 rounds them away from zero, q8_K to even
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5])
    x[1, block:2 * block] = ties.repeat(block // 8)
    x[1, block] = -127.0
    # row 2: every element of equal magnitude; row 3: the same with both signs of the largest magnitude
    x[2] = 0.75
    x[3] = torch.tensor([0.75, -0.75]).repeat(k // 2)
    got = run_mm(ops, x, raw, qtype).double()
    assert torch.equal(got[0], torch.zeros(n, dtype=torch.float64))
    xq, _ = quantize_ref(x, qtype)
    expected = xq @ w.T
    magnitude = xq.abs() @ w.abs().T
    assert ((got - expected).abs() <= 1e-5 * magnitude).all()
    # the ties really decide: the other rounding rule gives visibly different outputs for row 1
    v = x[1, block:2 * block].double()
    other = torch.round(v) if block == 32 else torch.sign(v) * torch.floor(v.abs() + 0.5)
    assert not torch.equal(other, xq[1, block:2 * block])
    wrong = xq[1].clone()
    wrong[block:2 * block] = other
    assert ((got[1] - wrong @ w.T).abs() > 1e-3 * magnitude[1]).any()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_mm_many_rows_and_threads(ops, qtype):
    """Enough weight rows for several tiles on every thread, against the reference (float32 x)."""
    k = 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 64
    raw = random_blocks(qtype, 300, k, seed=11)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    got = run_mm(ops, x, raw, qtype, pad=(0, 0)).double()
    xq, _ = quantize_ref(x, qtype)
    w = reference_dequant(raw, qtype, k).double()
    assert ((got - xq @ w.T).abs() <= 1e-4 * (xq.abs() @ w.abs().T)).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_decode_layout_gives_the_same_bits(ops, qtype):
    """The decode layout (rows in groups of 8, a block of each side by side) holds the same bytes, dequantizes to
    the same values and gives the same products up to float summation order (its kernels sum 8 rows at once; from
    4 activation rows on CPUs with AVX512-VNNI, 16 activation rows at a time: 6, 17 and 35 leave
    remainders)."""
    k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96
    for n in (40, 48):  # 48: 16-row tiles from 16 activation rows
        _check_decode_layout(ops, qtype, n, k)
    # 12 rows do not divide into groups of 8: they stay in the file's layout, and the kernel refuses to group them
    raw = random_blocks(qtype, 40, k, seed=int(qtype) + 5, scale=0.02)
    assert GGMLTensor.from_bytes(raw, qtype, (40, k)).narrow(0, 0, 12).grouped().group == 1
    with pytest.raises(RuntimeError, match="multiple of 8 rows"):
        ops.ggml_mm(torch.empty(1, 12), torch.randn(1, k), raw[:12].contiguous(), int(qtype), DECODE_GROUP)


def _check_decode_layout(ops, qtype, n, k):
    raw = random_blocks(qtype, n, k, seed=int(qtype) + n, scale=0.02)
    flat = GGMLTensor.from_bytes(raw, qtype, (n, k))
    grouped = flat.grouped()
    assert grouped.group == DECODE_GROUP and grouped.nbytes == flat.nbytes and not torch.equal(grouped.raw, raw)
    assert torch.equal(grouped.in_file_layout().raw, raw)
    assert torch.equal(grouped.dequantize(), flat.dequantize())
    assert torch.equal(ops.ggml_dequantize(grouped.raw, int(qtype), k, torch.float32, DECODE_GROUP),
                       ops.ggml_dequantize(raw, int(qtype), k, torch.float32))
    w = reference_dequant(raw, qtype, k).double()
    for m in (1, 3, 6, 17, 35):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want, got = torch.empty(m, n), torch.empty(m, n)
        ops.ggml_mm(want, x, raw, int(qtype))
        ops.ggml_mm(got, x, grouped.raw, int(qtype), DECODE_GROUP)
        xq, _ = quantize_ref(x, qtype)
        assert ((got.double() - want.double()).abs() <= 1e-5 * (xq.abs() @ w.abs().T)).all(), (n, m)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_mm_adds_a_bias_before_rounding(ops, qtype):
    """The bias rides in the kernel: float32 results are the product plus the bias; bfloat16 ones round that sum
    once, in both layouts."""
    k = 256
    raw = random_blocks(qtype, 16, k, seed=3, scale=0.02)
    grouped = GGMLTensor.from_bytes(raw, qtype, (16, k)).grouped().raw
    bias = torch.randn(16, generator=torch.Generator().manual_seed(5))
    for rows in (2, 5, 17):  # 5, 17: the tile kernels where the CPU has them
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4))
        for weights, group in ((raw, 1), (grouped, DECODE_GROUP)):
            plain, biased = torch.empty(rows, 16), torch.empty(rows, 16)
            ops.ggml_mm(plain, x, weights, int(qtype), group)
            ops.ggml_mm(biased, x, weights, int(qtype), group, bias)
            assert torch.equal(biased, plain + bias)
            rounded = torch.empty(rows, 16, dtype=torch.bfloat16)
            ops.ggml_mm(rounded, x.bfloat16(), weights, int(qtype), group, bias)
            plain_bf16 = torch.empty(rows, 16)
            ops.ggml_mm(plain_bf16, x.bfloat16().float(), weights, int(qtype), group)
            assert torch.equal(rounded, (plain_bf16 + bias).bfloat16())
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4))
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 vector of 16"):
        ops.ggml_mm(torch.empty(2, 16), x, raw, int(qtype), 1, bias.bfloat16())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_two_activation_levels_quantize_what_the_first_left(ops, qtype):
    """act_levels=2 (float32 runs): each activation row is quantized, then its remainder x - dequant(q8(x)) is
    quantized as well and both go through the weights. The result is within the second level's rounding of
    F.linear (over 50x closer than one level), on the decode kernels (1 row) and the tile kernels (5, 17 rows),
    in both layouts, with the bias added once and out's dtype rounded once."""
    k, n = (512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96), 48
    raw = random_blocks(qtype, n, k, seed=int(qtype) + 77, scale=0.02)
    grouped = GGMLTensor.from_bytes(raw, qtype, (n, k)).grouped().raw
    w = reference_dequant(raw, qtype, k).double()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6))
    for m in (1, 5, 17):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2
        exact = F.linear(x.double(), w) + bias.double()
        first, _ = quantize_ref(x, qtype)
        rest = (x.double() - first).float()  # what the kernel quantizes again (in float32)
        _, second_err = quantize_ref(rest, qtype)
        magnitude = x.double().abs() @ w.abs().T
        bound = (second_err + 2.0 ** -23 * rest.double().abs()) @ w.abs().T + 1e-5 * magnitude
        for weights, group in ((raw, 1), (grouped, DECODE_GROUP)):
            one, two = torch.empty(m, n), torch.empty(m, n)
            ops.ggml_mm(one, x, weights, int(qtype), group, bias, 1)
            ops.ggml_mm(two, x, weights, int(qtype), group, bias, 2)
            assert ((two.double() - exact).abs() <= bound).all(), (m, group)
            assert (two.double() - exact).abs().max() * 50 < (one.double() - exact).abs().max(), (m, group)
            rounded, wide = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(m, n)
            ops.ggml_mm(rounded, x.bfloat16(), weights, int(qtype), group, bias, 2)
            ops.ggml_mm(wide, x.bfloat16().float(), weights, int(qtype), group, bias, 2)
            assert torch.equal(rounded, wide.bfloat16())


def test_bad_arguments_are_rejected(ops):
    raw = random_blocks(Q.Q8_0, 4, 64, seed=1)
    with pytest.raises(RuntimeError, match="not supported"):
        ops.ggml_dequantize(raw, int(Q.Q2_K), 64, torch.float32)
    with pytest.raises(RuntimeError, match="bytes a row"):
        ops.ggml_dequantize(raw, int(Q.Q8_0), 96, torch.float32)
    with pytest.raises(RuntimeError, match="rows"):
        ops.ggml_mm(torch.empty(1, 5), torch.randn(1, 64), raw, int(Q.Q8_0))
    with pytest.raises(RuntimeError, match="dtype"):
        ops.ggml_mm(torch.empty(1, 4, dtype=torch.bfloat16), torch.randn(1, 64), raw, int(Q.Q8_0))
    with pytest.raises(RuntimeError, match="act_levels must be 1 or 2, not 3"):
        ops.ggml_mm(torch.empty(1, 4), torch.randn(1, 64), raw, int(Q.Q8_0), 1, None, 3)


def test_every_row_count_against_the_reference(ops):
    """ggml_mm at every activation row count from 1 to 17 (the decode kernels, the tiles decoded as they are swept
    and the tiles decoded once for many rows, and their remainders) and a few larger ones, over 48 weight rows and
    40 (not a multiple of 16: the 8-row tiles), in the file's layout and the decode layout, and ggml_dequantize of
    every row count, against the float64 reference of the same quantization."""
    for qtype, n in itertools.product(TYPES, (48, 40)):
        k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96
        raw = random_blocks(qtype, n, k, seed=int(qtype) + 321, scale=0.02)
        grouped = GGMLTensor.from_bytes(raw, qtype, (n, k)).grouped().raw
        w = reference_dequant(raw, qtype, k).double()
        for rows in range(1, 18):
            assert torch.equal(ops.ggml_dequantize(raw[:rows].contiguous(), int(qtype), k, torch.float32),
                               w[:rows].float()), (qtype.name, rows)
        for m in [*range(1, 18), 32, 64, 100]:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2
            xq, _ = quantize_ref(x, qtype)
            expected, magnitude = xq @ w.T, xq.abs() @ w.abs().T
            for weights, group in ((raw, 1), (grouped, DECODE_GROUP)):
                got = torch.empty(m, n)
                ops.ggml_mm(got, x, weights, int(qtype), group)
                assert ((got.double() - expected).abs() <= 1e-4 * magnitude).all(), (qtype.name, m, group)


def test_every_variant_computes_what_the_baseline_does(ops, baseline_ops):
    """The variant's kernels against the baseline build (the scalar reference, no arch/ kernels): the same
    dequantized values bit for bit, the same products up to float summation order, with one and two activation
    codes, in every dtype."""
    for i, qtype in enumerate(TYPES):
        k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96
        raw = random_blocks(qtype, 21, k, seed=i, scale=0.02)
        deq = baseline_ops.ggml_dequantize(raw, int(qtype), k, torch.float32)
        assert torch.equal(ops.ggml_dequantize(raw, int(qtype), k, torch.float32), deq)
        for dtype in DTYPES:
            x = (torch.randn(6, k, generator=torch.Generator().manual_seed(i)) * 2).to(dtype)
            xq, _ = quantize_ref(x, qtype)
            magnitude = xq.abs() @ deq.double().abs().T
            for levels in (1, 2):
                want, got = torch.empty(6, 21, dtype=dtype), torch.empty(6, 21, dtype=dtype)
                baseline_ops.ggml_mm(want, x, raw, int(qtype), 1, None, levels)
                ops.ggml_mm(got, x, raw, int(qtype), 1, None, levels)
                bound = 1e-5 * magnitude + output_ulp(dtype) * want.double().abs()
                assert ((got.double() - want.double()).abs() <= bound).all(), (qtype.name, dtype, levels)


def test_the_tile_kernels_are_built_where_the_variant_has_them(ops, variant):
    """ggml_mm's tile kernels (many activation rows) are compiled in exactly in the x86 variants with AVX2 (the
    AVX512-VNNI ones, or the 256-bit ones), for every type ggml_mm runs."""
    want = ["avx2" in variant.needs] * len(TYPES)
    assert [ops.ggml_mm_tiles(int(t)) for t in TYPES] == want
    assert not ops.ggml_mm_tiles(int(Q.Q2_K))


@pytest.mark.parametrize("probe, flag", [("ggml_amx_tiles", "amx_int8"), ("ggml_amx_bf16_tiles", "amx_bf16")])
def test_the_amx_kernels_run_where_the_cpu_has_amx(ops, variant, probe, flag):
    """ggml_mm's AMX kernels (int8 for the K-quants, bf16 for the 32-blocks) are built into the AVX512-BF16 variant
    (every AMX CPU has AVX512-BF16) and run where the CPU reports AMX-TILE and their AMX-INT8 or AMX-BF16;
    ggml_allow_amx(False) keeps both off."""
    runs = getattr(ops, probe)
    expected = "avx512_bf16" in variant.needs and {"amx_tile", flag} <= this_cpu_flags()
    assert runs() == expected
    ops.ggml_allow_amx(False)
    try:
        assert not runs()
    finally:
        ops.ggml_allow_amx(True)
    assert runs() == expected


AMX_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _mm_with_and_without_amx(ops, x, weights, qtype, n, levels=1):
    got = []
    try:
        for allow in (True, False):
            ops.ggml_allow_amx(allow)
            y = torch.empty(x.shape[0], n, dtype=x.dtype)
            ops.ggml_mm(y, x, weights, int(qtype), DECODE_GROUP, None, levels)
            got.append(y)
    finally:
        ops.ggml_allow_amx(True)
    return got


@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda q: q.name)
def test_the_amx_kernel_gives_the_vnni_sweeps_results(ops, qtype):
    """The AMX kernel (K-quants in the decode layout, from 32 activation rows, weight rows a multiple of 16) forms
    the same integer sum per super-block as the AVX512-VNNI sweep and scales it the same way: the same results bit
    for bit, in every dtype, with one and two activation codes, for whole and partial pairs of 16-row groups; and
    exact at the largest codes, where a wrong split of scale x code into its two bytes would show."""
    if not ops.ggml_amx_tiles():
        pytest.skip("this variant or CPU runs no AMX kernel")
    k, n = 512, 48
    raw = random_blocks(qtype, n, k, seed=int(qtype) + 77, scale=0.02)
    grouped = GGMLTensor.from_bytes(raw, qtype, (n, k)).grouped().raw
    for m in (32, 33, 47, 64, 100):
        for dtype in DTYPES:
            x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2).to(dtype)
            for levels in (1, 2):
                amx, vnni = _mm_with_and_without_amx(ops, x, grouped, qtype, n, levels)
                assert torch.equal(amx, vnni), (m, dtype, levels)
    raw, grouped, _, _ = exact_cases(qtype, n=48)
    x = exact_activations(33, k, 256, seed=33)
    expected = x.double() @ reference_dequant(raw, qtype, k).double().T
    amx, vnni = _mm_with_and_without_amx(ops, x, grouped, qtype, 48)
    assert torch.equal(amx.double(), expected) and torch.equal(vnni.double(), expected)


AMX_BF16_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0]


@pytest.mark.parametrize("qtype", AMX_BF16_TYPES, ids=lambda q: q.name)
def test_the_amx_bf16_kernel_multiplies_the_dequantized_bf16_weights(ops, qtype):
    """The AMX bf16 kernel (32-blocks in the decode layout, bf16 runs, from 32 activation rows, weight rows a
    multiple of 16) multiplies the activations as they are by the weights ggml_dequantize gives in bf16, summing in
    float: within one bf16 rounding of the float64 product, for whole and partial groups of 16 activation rows and
    pairs of weight groups. The int8 path it replaces quantizes the activations and misses that bound, so the test
    also shows which kernel ran."""
    if not ops.ggml_amx_bf16_tiles():
        pytest.skip("this variant or CPU runs no AMX bf16 kernel")
    k, n = 320, 48
    raw = random_blocks(qtype, n, k, seed=int(qtype) + 91, scale=0.02)
    grouped = GGMLTensor.from_bytes(raw, qtype, (n, k)).grouped().raw
    weights = ops.ggml_dequantize(grouped, int(qtype), k, torch.bfloat16, DECODE_GROUP).double()
    for m in (32, 33, 47, 64, 100):
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2).to(torch.bfloat16)
        exact = x.double() @ weights.T
        amx, int8 = _mm_with_and_without_amx(ops, x, grouped, qtype, n)
        ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
        assert ((amx.double() - exact).abs() <= ulp).all(), m
        assert ((int8.double() - exact).abs() > ulp).any(), m


def test_activations_round_half_away_from_zero_as_ggml(ops):
    """Activation codes are round(x / d) with ties away from zero (ggml's quantize_row_q8_0_ref, roundf): with
    d = 1 (max |x| = 127) and Q8_0 weight rows that pick one input each, the outputs are the codes themselves, on
    the decode kernels (1 row) and the tile kernels (5 and 17 rows) alike."""
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, 100.5, -100.5, 0.49, -0.51] + [0.0] * 20)
    want = torch.tensor([127.0, 1, 2, 3, -1, -2, -3, 3, 101, -101, 0, -1] + [0.0] * 20)
    blocks = torch.zeros(32, 34, dtype=torch.uint8)
    blocks[:, 1] = 0x3C  # d = 1.0 in fp16
    blocks[torch.arange(32), 2 + torch.arange(32)] = 1  # row j: code 1 at input j
    grouped = GGMLTensor.from_bytes(blocks, Q.Q8_0, (32, 32)).grouped()
    for rows in (1, 5, 17):
        for raw, group in ((blocks, 1), (grouped.raw, DECODE_GROUP)):
            out = torch.empty(rows, 32)
            ops.ggml_mm(out, x.repeat(rows, 1), raw, int(Q.Q8_0), group)
            assert torch.equal(out, want.repeat(rows, 1)), (rows, group, out[0])


def exact_blocks(qtype, rows, cols, seed):
    """Weights whose products with integer activations are exact in float32: fp16 scales of +-1 (mins 0, 1, -1),
    sub-block scales in [0, 3] (Q6_K's in [-3, 3]), random codes except that the first 3 rows of every 8 hold the
    largest codes (Q8_0: -128, -128, 127), where u8 x s8 pair sums come closest to int16's limit."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    extreme = (np.arange(rows) % 8 < 3)[:, None]

    def pick_fp16(*values):  # one of values per block, as its two bytes
        chosen = np.array(values, np.float16)[rng.integers(0, len(values), blocks.shape[:2])]
        return chosen.view(np.uint8).reshape(blocks.shape[:2] + (2,))

    codes = {Q.Q4_0: (2, 18), Q.Q4_1: (4, 20), Q.Q5_0: (2, 22), Q.Q4_K: (16, 144), Q.Q5_K: (16, 176),
             Q.Q6_K: (0, 192)}
    if qtype == Q.Q8_0:
        blocks[:, :, 2:] = np.where(extreme[:, :, None], np.where(np.arange(rows) % 8 < 2, 0x80, 0x7F)[:, None, None],
                                    blocks[:, :, 2:])
    else:
        lo, hi = codes[qtype]
        blocks[:, :, lo:hi] = np.where(extreme[:, :, None], 0xFF, blocks[:, :, lo:hi])
    if qtype in (Q.Q4_K, Q.Q5_K):  # bytes 4-7 scales 0-3, 8-11 mins 0-3 (their top bits: 4-7's), 12-15 nibbles of 4-7
        blocks[:, :, 4:12] = rng.integers(0, 4, blocks.shape[:2] + (8,))
        scales, mins = rng.integers(0, 4, (2,) + blocks.shape[:2] + (4,))
        blocks[:, :, 12:16] = scales | mins << 4
    if qtype == Q.Q6_K:
        blocks[:, :, 192:208] = rng.integers(-3, 4, blocks.shape[:2] + (16,)).astype(np.int8).view(np.uint8)
    scale_at = SCALE_OFFSETS[qtype][0]
    blocks[:, :, scale_at:scale_at + 2] = pick_fp16(1.0, -1.0)
    if len(SCALE_OFFSETS[qtype]) == 2:  # Q4_1's m, the K-quants' dmin
        blocks[:, :, 2:4] = pick_fp16(1.0, 0.0, -1.0)
    return torch.from_numpy(blocks.reshape(rows, -1))


def exact_activations(m, k, block, seed):
    """Integer activations that ggml's quantizers keep as they are (every block holds a +-127, so d = +-1): rows of
    all 127, all -127, then random ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (m, k), generator=g).float()
    x[:, ::block] = torch.where(torch.rand(m, k // block, generator=g) < 0.5, 127.0, -127.0)
    x[0::3] = 127.0
    x[1::3] = -127.0
    return x


EXACT_ROWS = (1, 3, 4, 5, 9, 17, 20)


def exact_cases(qtype, n=40):
    """(raw, grouped raw, xs, the exact products) for exact_blocks and exact_activations"""
    block = GGML_QUANT_SIZES[qtype][0]
    k = 512 if block == 256 else 160
    raw = exact_blocks(qtype, n, k, seed=int(qtype))
    grouped = GGMLTensor.from_bytes(raw, qtype, (n, k)).grouped().raw
    w = reference_dequant(raw, qtype, k).double()
    xs = [exact_activations(m, k, block, seed=m) for m in EXACT_ROWS]
    want = [x.double() @ w.T for x in xs]
    assert all((p.abs() < 2 ** 24).all() and (p == p.round()).all() for p in want)  # float32 holds them exactly
    return raw, grouped, xs, want


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_mm_is_exact_at_the_largest_codes(ops, qtype):
    """With integer activations that quantize to themselves and weights whose products stay below 2^24, every
    kernel (decode, tiles; both layouts) gives the integer products exactly, at the largest codes against +-127
    included: where int16 pair sums saturated or wrapped, the results would be far off."""
    raw, grouped, xs, want = exact_cases(qtype)
    for x, expected in zip(xs, want):
        for weights, group in ((raw, 1), (grouped, DECODE_GROUP)):
            got = torch.empty(x.shape[0], raw.shape[0])
            ops.ggml_mm(got, x, weights, int(qtype), group)
            assert torch.equal(got.double(), expected), (x.shape[0], group)

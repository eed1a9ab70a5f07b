"""The int8 roof (kernels/cpu/roof.cpp): each kernel variant's op times the loop of its own tile kernel's int8
instructions and returns positive rates with their name. Functional only: the rates are not compared with any
figure, since a shared machine may run them at any speed."""
import math

import pytest
from helpers import variant_ops, variant_params

from qwenserve.config.cpu_variants import machine_arch, variants_for

# variant -> how the name of its loop starts: the instructions its int8 tile kernel runs (ggml/dispatch.cpp)
INSTRUCTIONS = {
    "x86_64": "C++ int8 dot loop",
    "avx2": "8 x vpmaddubsw+vpaddw, vpmaddwd+vpaddd ymm",
    "avx_vnni": "vpdpbusd ymm",
    "avx512": "8 x vpmaddubsw+vpaddw, vpmaddwd+vpaddd ymm",  # no VNNI: the 256-bit tiles' mix for 4-bit codes
    "avx512_vnni": "vpdpbusd zmm",
    "avx512_bf16": "vpdpbusd zmm",
    "armv8": "smull+smull2+sadalp",
    "armv8_dotprod": "sdot",
    "armv8_i8mm": "smmla",
}


def test_every_variant_has_its_instructions_named():
    assert set(INSTRUCTIONS) == {v.name for arch in ("x86_64", "aarch64") for v in variants_for(arch)}


@pytest.mark.parametrize("variant", variant_params() or [pytest.param(None, id="none")])
def test_int8_roof_times_the_variants_own_instructions(variant):
    if variant is None:
        pytest.skip(f"no kernel variants for {machine_arch()}")
    ops = variant_ops(variant)
    per_core, all_threads, name = ops.int8_roof(0, 0.05)
    assert name.startswith(INSTRUCTIONS[variant.name]), (variant.name, name)
    assert math.isfinite(per_core) and per_core > 0
    assert math.isfinite(all_threads) and all_threads > 0
    # loose: a busy machine may give the threads less than a core each, never far less than one core in all
    assert all_threads >= 0.5 * per_core, (per_core, all_threads)
    one = ops.int8_roof(1, 0.05)
    assert one[2] == name and one[0] > 0 and one[1] > 0


def test_int8_roof_amx_only_where_the_kernels_run_it(ops):
    if ops.ggml_amx_tiles():
        per_core, all_threads, name = ops.int8_roof(0, 0.05, True)
        assert name.startswith("tdpbsud+tdpbssd") and per_core > 0 and all_threads > 0
    else:
        with pytest.raises(RuntimeError, match="AMX"):
            ops.int8_roof(0, 0.05, True)


def test_int8_roof_checks_its_arguments(ops):
    with pytest.raises(RuntimeError, match="threads"):
        ops.int8_roof(-1, 0.05)
    with pytest.raises(RuntimeError, match="seconds"):
        ops.int8_roof(0, 0.0)

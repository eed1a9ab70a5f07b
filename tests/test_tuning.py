"""The tuning table (config/tuning.py): which class each CPU gets, and the choices each class makes, pinned to the
values the measurements in docs/tuning.md set. A change to a threshold has to change this test too."""
import sys
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from qwenserve.config import tuning
from qwenserve.config.engine_config import SchedulerConfig
from qwenserve.model.layers.quantization.ggml_blocks import (
    activation_levels,
    dense_route,
    tiles_dense_from_rows,
)
from qwenserve.model.loader.ggml_tensor import GGMLTensor

# class -> (bf16 dense route, 32-block tiles' dense threshold, K-quant tiles' dense threshold, the same two where the
# AMX kernels run) with bf16 dense
EXPECTED = {
    "amx": ((32, torch.bfloat16), 128, 96, 512, 512),
    "avx512_bf16": ((32, torch.bfloat16), sys.maxsize, sys.maxsize, sys.maxsize, sys.maxsize),
    "portable": ((128, torch.float32), sys.maxsize, sys.maxsize, sys.maxsize, sys.maxsize),
}


@pytest.mark.parametrize("amx, bf16, expected", [
    (True, True, "amx"), (False, True, "avx512_bf16"), (False, False, "portable"),
])
def test_the_cpu_features_choose_the_class(monkeypatch, amx, bf16, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16, raising=False)
    assert tuning.cpu_feature_class() == expected


def _tiled_layer(table, dense_dtype, ggml_type, amx=False):
    """A layer as process_weights_after_loading sees it: one decode-layout segment the tile kernel runs (and, with
    amx, kernels whose AMX kernel runs)."""
    segment = GGMLTensor(torch.zeros(8, 34, dtype=torch.uint8), ggml_type, (8, 32), group=8)
    return SimpleNamespace(tuning=table, dense_dtype=dense_dtype, segments=[(0, segment)],
                           ggml_ops=SimpleNamespace(ggml_mm_tiles=lambda _: True, ggml_amx_tiles=lambda: amx,
                                                    ggml_amx_bf16_tiles=lambda: amx))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_class_chooses_the_measured_thresholds(name):
    table = tuning.TUNING_BY_CLASS[name]
    bf16_route, tiles_32_blocks, tiles_k_quants, amx_tiles_32_blocks, amx_tiles_k_quants = EXPECTED[name]
    assert table.feature_class == name
    assert dense_route(torch.float32, table) == (64, torch.float32)
    assert dense_route(torch.bfloat16, table) == bf16_route
    assert dense_route(torch.float16, table) == (128, torch.float32)
    bf16_dense = bf16_route[1]
    assert tiles_dense_from_rows(_tiled_layer(table, bf16_dense, Q.Q5_0)) == (
        tiles_32_blocks if bf16_dense == torch.bfloat16 else sys.maxsize)
    assert tiles_dense_from_rows(_tiled_layer(table, bf16_dense, Q.Q6_K)) == (
        tiles_k_quants if bf16_dense == torch.bfloat16 else sys.maxsize)
    # where the AMX kernels run: int8 for the K-quants, bf16 for the 32-weight blocks (a bf16 dense route only)
    assert tiles_dense_from_rows(_tiled_layer(table, bf16_dense, Q.Q6_K, amx=True)) == (
        amx_tiles_k_quants if bf16_dense == torch.bfloat16 else sys.maxsize)
    assert tiles_dense_from_rows(_tiled_layer(table, bf16_dense, Q.Q5_0, amx=True)) == (
        amx_tiles_32_blocks if bf16_dense == torch.bfloat16 else sys.maxsize)
    assert tiles_dense_from_rows(_tiled_layer(table, torch.float32, Q.Q5_0)) == sys.maxsize
    assert tiles_dense_from_rows(_tiled_layer(table, torch.float32, Q.Q4_K)) == sys.maxsize
    assert (activation_levels(torch.float32, table), activation_levels(torch.bfloat16, table),
            activation_levels(torch.float16, table)) == (2, 1, 1)
    assert (table.dense_slice_weights, table.mlp_rows_per_pass) == (1 << 20, 512)
    assert (table.pipelined_step_tokens, table.head_cost_share) == (512, 0.6)
    assert table.fp8_tiles_from_rows == (32 if name == "avx512_bf16" else sys.maxsize)


def test_without_the_tile_kernel_the_table_is_not_asked():
    layer = _tiled_layer(tuning.AMX, torch.bfloat16, Q.Q5_0)
    layer.ggml_ops = SimpleNamespace()  # kernels built without VNNI tiles
    assert tiles_dense_from_rows(layer) is None


def test_the_scheduler_setting_defaults_to_this_cpus_table():
    assert SchedulerConfig().pipelined_step_tokens == tuning.this_cpu_tuning().pipelined_step_tokens == 512
    assert SchedulerConfig(pipelined_step_tokens=128).pipelined_step_tokens == 128
    with pytest.raises(ValueError, match="pipelined_step_tokens must be a positive integer"):
        SchedulerConfig(pipelined_step_tokens=0)

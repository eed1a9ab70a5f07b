"""quantization="gguf": a GGUF file's quantized blocks stay in memory and our kernels run them. Checked on tiny
random models written as GGUF (32-weight block types; the K-quants need rows of 256, covered by
tests/test_ggml_kernels.py and the bundled model): the model keeps the file's bytes, not dense weights; its
logits follow the exact (dequantized) path within what int8 activations cost (one code each in bf16, two in
float32; none on an AMX CPU's bf16 tiles); without the kernels it dequantizes at load and equals the exact path
bit for bit; bad combinations are errors that name them."""
import json
import os

import pytest
import torch
from helpers import dense_route_from, save_gguf, save_hf_dir, tiny_hf_model

from qwenserve import LLM, kernels
from qwenserve.config.errors import ConfigError
from qwenserve.model.loader.ggml_tensor import GGMLTensor
from qwenserve.model.loader.gguf_file import GGUFFile
from qwenserve.model.loader.model_loader import LoadedModel
from qwenserve.worker.model_runner import full_logits

# as llama.cpp's Q4_K_M does with the 32-weight types: v and down in more bits than the rest
MIXED = {"v_proj": "Q8_0", "down_proj": "Q8_0", "lm_head": "Q8_0"}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    hf = tiny_hf_model(seed=61, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    return save_gguf(hf, str(tmp_path_factory.mktemp("q") / "mixed.gguf"), "Q5_0", MIXED)



def engine_model(llm):
    return llm.engine.executor.worker.model


def test_quantized_layers_hold_the_files_blocks(ops, mixed_gguf):
    llm = LLM(mixed_gguf, dtype="float32", kv_cache_memory="4MiB")
    assert llm.engine.resolved_model.quantization == "gguf"  # detected from the file
    model = engine_model(llm)
    qkv = model.model.layers[0].self_attn.qkv_proj
    types = [(offset, seg.ggml_type.name, seg.shape[0]) for offset, seg in qkv.segments]
    # q and k (both Q5_0, adjacent) run as one segment; v keeps its Q8_0
    assert types == [(0, "Q5_0", 64 + 32), (96, "Q8_0", 32)]
    assert qkv.weight.numel() == 0  # no dense copy
    f = GGUFFile(mixed_gguf)
    embedding = model.model.embed_tokens
    assert embedding.blocks.ggml_type.name == "Q5_0" and embedding.weight.numel() == 0
    held = sum(seg.nbytes for m in model.modules() if getattr(m, "segments", None) for _, seg in m.segments)
    in_file = sum(t.nbytes for t in f.tensors.values() if len(t.shape) == 2)
    assert held + embedding.blocks.nbytes == in_file  # every 2-D weight byte of the file, nothing more
    ids = torch.tensor([[3, 0, 250], [7, 7, 319]])
    dense = embedding.blocks.dequantize()
    assert torch.equal(embedding(ids), dense[ids])  # a lookup dequantizes just its rows, exactly
    assert all(isinstance(seg, GGMLTensor) for m in model.modules() if getattr(m, "segments", None)
               for _, seg in m.segments)


@pytest.mark.slow
def test_logits_follow_the_exact_path(ops, mixed_gguf):
    exact = LoadedModel(mixed_gguf, dtype="float32", quantization="none").model
    quantized = LoadedModel(mixed_gguf, dtype="float32", quantization="gguf").model
    # prefill-sized: the blocks are dequantized and run dense, as the exact path runs them
    many = list(range(3, 3 + dense_route_from(quantized) + 6))
    torch.testing.assert_close(full_logits(quantized, many), full_logits(exact, many), atol=1e-4, rtol=1e-4)
    # decode-sized: integer dot products on quantized activations. In float32 each activation gets two int8
    # codes (the second for what the first left): within 1e-3 of the exact path, the same next-token choices
    few = list(range(9, 49))
    got, want = full_logits(quantized, few), full_logits(exact, few)
    assert (got - want).norm() < 1e-3 * want.norm()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # in bfloat16 one code, as llama.cpp: close, and the same next-token choices mostly. An AMX CPU takes these
    # rows to its bf16 tiles, which do not quantize the activations: the codes are checked with them off
    exact = LoadedModel(mixed_gguf, dtype="bfloat16", quantization="none").model
    quantized = LoadedModel(mixed_gguf, dtype="bfloat16", quantization="gguf").model
    want = full_logits(exact, few).float()
    ops.ggml_allow_amx(False)
    try:
        got = full_logits(quantized, few).float()
    finally:
        ops.ggml_allow_amx(True)
    assert 1e-3 * want.norm() < (got - want).norm() < 0.05 * want.norm()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.9, f"only {agree:.0%} of next-token choices agree with the exact path"
    if ops.ggml_amx_bf16_tiles():  # the 32-blocks on bf16 tiles: the exact path's bf16 weights and activations
        got = full_logits(quantized, few).float()
        assert (got - want).norm() < 1e-3 * want.norm()


def test_a_tied_head_runs_the_embeddings_blocks(ops, tmp_path):
    """A tied LM head multiplies the embedding's own blocks with ggml_mm (no dense copy of the vocabulary matrix
    anywhere); the embedding looks its rows up in the head's decode layout; the head's logits equal hidden states
    times the dequantized embedding within what the activation codes cost."""
    hf = tiny_hf_model(seed=63, tie_word_embeddings=True)
    path = save_gguf(hf, str(tmp_path / "tied.gguf"), "Q5_0")
    model = LoadedModel(path, dtype="float32", quantization="gguf").model
    embedding, head = model.model.embed_tokens, model.lm_head
    (_, blocks), = head.segments
    assert blocks is embedding.blocks and blocks.group == 8 and blocks.ggml_type.name == "Q5_0"
    assert head.weight is embedding.weight and embedding.weight.numel() == 0
    held = sum(seg.nbytes for m in model.modules() if getattr(m, "segments", None) for _, seg in m.segments)
    in_file = sum(t.nbytes for t in GGUFFile(path).tensors.values() if len(t.shape) == 2)
    assert held == in_file  # the embedding's blocks counted once, through the head
    dense = blocks.dequantize()
    ids = torch.tensor([[3, 0, 250], [7, 7, 319]])
    assert torch.equal(embedding(ids), dense[ids])
    hidden = torch.randn(5, dense.shape[1])
    for rows in (1, 5):  # one row (two codes) and a batch (two codes in float32)
        got, want = head.compute_logits(hidden[:rows]), hidden[:rows] @ dense.T
        assert (got - want).norm() < 1e-3 * want.norm()
    exact = LoadedModel(path, dtype="float32", quantization="none").model
    few = list(range(9, 49))
    assert torch.equal(full_logits(model, few).argmax(-1), full_logits(exact, few).argmax(-1))


def test_a_tied_head_over_a_dense_embedding_shares_its_weight(ops, tmp_path):
    hf = tiny_hf_model(seed=64, tie_word_embeddings=True)
    model = LoadedModel(save_gguf(hf, str(tmp_path / "tied.gguf"), "Q8_0", {"embed_tokens": "F32"}),
                        dtype="float32", quantization="gguf").model
    assert model.model.embed_tokens.blocks is None
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.shape == (320, 64)
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(model.lm_head.compute_logits(hidden), hidden @ model.lm_head.weight.T)


def test_without_kernels_the_blocks_are_dequantized_at_load(mixed_gguf, caplog):
    with kernels.disabled(), caplog.at_level("WARNING"):  # both on the PyTorch ops, so they may be equal
        quantized = LoadedModel(mixed_gguf, dtype="float32", quantization="gguf").model
        exact = LoadedModel(mixed_gguf, dtype="float32", quantization="none").model
    assert "dequantized at load" in caplog.text
    ids = list(range(7, 30))
    assert torch.equal(full_logits(quantized, ids), full_logits(exact, ids))


def test_bad_quantization_settings_name_the_problem(tmp_path, mixed_gguf):
    hf_dir = save_hf_dir(tiny_hf_model(seed=62), str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="quantization gguf runs a GGUF file's blocks, but .* is not a GGUF"):
        LLM(hf_dir, quantization="gguf")
    with pytest.raises(ConfigError, match="quantization 'int3' is not supported; use one of none, gguf, int8, int4, awq, gptq"):
        LLM(mixed_gguf, quantization="int3")
    config_path = os.path.join(hf_dir, "config.json")
    config = json.load(open(config_path))
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ConfigError, match="holds 'bitsandbytes'-quantized weights .* it loads: awq, gptq"):
        LLM(hf_dir)
    with pytest.raises(ConfigError, match="quantization awq loads AWQ checkpoints, but .* is gguf-quantized"):
        LLM(mixed_gguf, quantization="awq")


def test_row_parallel_split_inside_k_quant_blocks_requantizes_to_q8_0():
    """tp = 2 halves the 0.5B model's 4864-wide Q6_K/Q4_K down_proj at column 2432, inside a 256-weight block:
    that rank's part is re-quantized to Q8_0, which stays within Q8_0's rounding of the file's values."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from qwenserve.model.layers.quantization.gguf import _columns

    q6k = GGMLQuantizationType.Q6_K
    rows, cols = 4, 768
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, GGML_QUANT_SIZES[q6k][1]), dtype=np.uint8)
    blocks[:, 208:210] = rng.uniform(0.01, 0.02, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    tensor = GGMLTensor.from_bytes(torch.from_numpy(blocks.reshape(rows, -1)), q6k, (rows, cols))
    part = _columns(tensor, 384, 384)
    assert part.ggml_type == GGMLQuantizationType.Q8_0 and part.shape == (rows, 384)
    expected = tensor.dequantize()[:, 384:]
    step = expected.reshape(rows, -1, 32).abs().amax(-1, keepdim=True) / 127  # each block's Q8_0 scale
    error = (part.dequantize() - expected).reshape(rows, -1, 32).abs()
    assert (error <= step * 0.51 + 1e-6).all()  # half a step, the fp16 scale's rounding aside
    assert _columns(tensor, 0, 512).ggml_type == q6k  # a split on block boundaries keeps the file's blocks
    with pytest.raises(ValueError, match="cannot split"):
        _columns(tensor, 0, 100)  # not even a 32-weight boundary


def test_a_row_gets_the_same_codes_alone_and_among_others(ops, mixed_gguf):
    """bf16 runs give each activation one int8 code, as llama.cpp, whether the row is alone (batch-1 decode) or
    among others, so a request's logits do not depend on how many rows share its step; float32 runs give two, at
    every row count too (ggml_blocks.activation_levels)."""
    for dtype, levels in ((torch.bfloat16, 1), (torch.float32, 2)):
        model = LoadedModel(mixed_gguf, dtype=str(dtype).removeprefix("torch."), quantization="gguf").model
        layer = model.model.layers[0].self_attn.o_proj
        (_, segment), = layer.segments
        x = torch.randn(5, layer.input_size, generator=torch.Generator().manual_seed(3)).to(dtype)

        def kernel(rows, codes):
            out = rows.new_empty(rows.shape[0], layer.output_size)
            ops.ggml_mm(out, rows, segment.raw, int(segment.ggml_type), segment.group, None, codes)
            return out

        with torch.inference_mode():
            alone, among = layer.linear_method.apply(layer, x[:1], None), layer.linear_method.apply(layer, x, None)
            assert torch.equal(alone, kernel(x[:1], levels)) and torch.equal(among, kernel(x, levels))
            assert not torch.equal(alone, kernel(x[:1], 3 - levels))
            torch.testing.assert_close(alone[0], among[0], rtol=1e-5, atol=1e-5)

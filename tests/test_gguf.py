"""GGUF: our reader and dequantizers against the gguf package, and whole tiny GGUF models against HF."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from qwenserve.model.loader.checkpoint import GGUFCheckpoint, gguf_to_hf_name
from qwenserve.model.loader.dequant import dequantize
from qwenserve.model.loader.gguf_file import GGUFFile
from qwenserve.model.loader.model_loader import LoadedModel
from qwenserve.worker.model_runner import full_logits

from helpers import save_gguf, tiny_hf_model

Q = GGMLQuantizationType
# where each block format keeps its fp16 scale(s): random bytes there could be inf/nan
SCALE_OFFSETS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208], Q.Q5_K: [0, 2],
                 Q.Q2_K: [80, 82], Q.Q3_K: [108]}


@pytest.mark.parametrize("qtype", list(SCALE_OFFSETS), ids=lambda q: q.name)
def test_dequantize_random_blocks_equals_gguf_reference(qtype):
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    blocks = rng.integers(0, 256, size=(64, block_bytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        blocks[:, off:off + 2] = rng.uniform(-2, 2, size=(64, 1)).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(-1)
    shape = (8, 64 * block_elems // 8)
    expected = torch.from_numpy(quants.dequantize(raw, qtype).reshape(shape).astype(np.float32))
    assert torch.equal(dequantize(raw, qtype, shape), expected)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16])
def test_dequantize_float_formats(qtype):
    x = torch.randn(4, 32)
    raw = {Q.F32: x, Q.F16: x.half(), Q.BF16: x.bfloat16()}[qtype]
    expected = raw.float()
    got = dequantize(raw.contiguous().view(torch.uint8).numpy().reshape(-1), qtype, (4, 32))
    assert torch.equal(got, expected)


def test_gguf_name_mapping():
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.11.ffn_down.weight") == "model.layers.11.mlp.down_proj.weight"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("blk.0.unknown.weight") == "blk.0.unknown.weight"


@pytest.mark.parametrize("quant", ["Q8_0", "Q5_0", "F16"])
def test_tiny_gguf_loads_like_hf_loads_it(tmp_path, quant):
    """HF transformers reads the same GGUF (dequantizing with the gguf package); logits must agree."""
    from qwenserve.tools.compare import load_hf_model
    hf = tiny_hf_model(seed=11)
    path = save_gguf(hf, str(tmp_path / "tiny.gguf"), quant)
    ours = LoadedModel(path, dtype="float32")
    assert ours.config.num_key_value_heads == 2 and not ours.config.tie_word_embeddings
    reference = load_hf_model(path)
    ids = list(range(5, 45))
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(ours.model, ids), expected, atol=2e-5, rtol=1e-4)


def test_tied_gguf_without_output_tensor(tmp_path):
    hf = tiny_hf_model(seed=12, tie_word_embeddings=True)
    ours = LoadedModel(save_gguf(hf, str(tmp_path / "tied.gguf"), "F16"), dtype="float32")
    assert ours.config.tie_word_embeddings
    assert ours.model.lm_head.weight is ours.model.model.embed_tokens.weight


def test_reader_metadata_and_tensor_table(tmp_path):
    hf = tiny_hf_model(seed=13)
    f = GGUFFile(save_gguf(hf, str(tmp_path / "t.gguf"), "Q8_0"))
    assert f.metadata["general.architecture"] == "qwen2"
    assert f.metadata["qwen2.embedding_length"] == 64
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 320
    info = f.tensors["blk.0.attn_q.weight"]
    assert info.shape == (64, 64) and info.ggml_type == Q.Q8_0
    assert f.tensors["blk.0.attn_k.bias"].shape == (32,)


def test_gguf_tokenizer_roundtrip_and_chat_template(tmp_path):
    hf = tiny_hf_model(seed=14)
    tok = GGUFCheckpoint(save_gguf(hf, str(tmp_path / "t.gguf"))).tokenizer()
    text = "the weather in 北京 🙂\n\tok"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<|im_start|>")]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(bad))


def test_truncated_gguf_is_reported(tmp_path):
    hf = tiny_hf_model(seed=15)
    path = save_gguf(hf, str(tmp_path / "t.gguf"), "F16")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-4096])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFFile(path)


def test_config_from_gguf_metadata_with_yarn():
    from qwenserve.model.loader.checkpoint import config_from_gguf
    md = {"general.architecture": "qwen2", "qwen2.block_count": 2, "qwen2.context_length": 131072,
          "qwen2.embedding_length": 64, "qwen2.feed_forward_length": 128, "qwen2.attention.head_count": 4,
          "qwen2.attention.head_count_kv": 2, "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
          "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
          "qwen2.rope.scaling.original_context_length": 32768, "tokenizer.ggml.tokens": ["a"] * 100}
    cfg = config_from_gguf(md)
    assert cfg.rope_theta == 1_000_000.0  # absent freq_base: Qwen2's default
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert cfg.resolve_max_model_len(None) == 131072
    assert cfg.vocab_size == 100
    with pytest.raises(ValueError, match="general.architecture is 'llama'"):
        config_from_gguf({**md, "general.architecture": "llama"})
    with pytest.raises(ValueError, match="lacks qwen2.block_count"):
        config_from_gguf({k: v for k, v in md.items() if k != "qwen2.block_count"})

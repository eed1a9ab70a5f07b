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

from helpers import save_gguf, tiny_hf_model, tiny_qwen3

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


# malformed metadata and tensors ----------------------------------------------------------------------------------

def save_gguf_edited(monkeypatch, model, path: str, quant: str = "F32", keys: dict | None = None,
                     drop_tensors: tuple[str, ...] = ()) -> str:
    """save_gguf, with metadata keys ("{arch}" stands for the file's architecture) set to the given values
    (int: uint32, float: float32, str: string) and the named tensors left out."""
    import gguf

    class EditingWriter(gguf.GGUFWriter):
        def write_header_to_file(self, *args, **kwargs):
            for key, value in (keys or {}).items():
                key = key.replace("{arch}", self.arch)
                self.kv_data[0].pop(key, None)
                add = {int: self.add_uint32, float: self.add_float32, str: self.add_string}[type(value)]
                add(key, value)
            for name in drop_tensors:
                del self.tensors[0][name]
            return super().write_header_to_file(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFWriter", EditingWriter)
    return save_gguf(model, path, quant)


def qwen3_metadata(**changes) -> dict:
    md = {"general.architecture": "qwen3", "qwen3.block_count": 2, "qwen3.context_length": 512,
          "qwen3.embedding_length": 64, "qwen3.feed_forward_length": 128, "qwen3.attention.head_count": 4,
          "qwen3.attention.head_count_kv": 2, "qwen3.attention.key_length": 32,
          "qwen3.attention.value_length": 32, "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
          "tokenizer.ggml.tokens": ["a"] * 100}
    md.update({f"qwen3.{k}": v for k, v in changes.items()})
    return {k: v for k, v in md.items() if v is not None}


def test_gguf_with_more_layers_than_block_count_is_refused(tmp_path, monkeypatch):
    from qwenserve.model.loader.model_loader import WeightLoadError
    path = save_gguf_edited(monkeypatch, tiny_qwen3(seed=21), str(tmp_path / "deep.gguf"),
                            keys={"{arch}.block_count": 1})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.\S+ is a tensor of layer 1, but GGUF metadata "
                                              r"qwen3\.block_count is 1"):
        LoadedModel(path, dtype="float32")


def test_moe_gguf_with_more_layers_than_block_count_is_refused(tmp_path, monkeypatch):
    from test_moe import tiny_moe
    from qwenserve.model.loader.model_loader import WeightLoadError
    path = save_gguf_edited(monkeypatch, tiny_moe("qwen2_moe", seed=32), str(tmp_path / "deep.gguf"),
                            keys={"{arch}.block_count": 2})
    with pytest.raises(WeightLoadError, match=r"is a tensor of layer 2, but GGUF metadata qwen2moe\.block_count is 2"):
        LoadedModel(path, dtype="float32")


def test_hf_dir_with_more_layers_than_its_config_is_refused(tmp_path):
    import json
    from helpers import save_hf_dir
    from qwenserve.model.loader.model_loader import WeightLoadError
    path = save_hf_dir(tiny_qwen3(seed=21), str(tmp_path / "deep"))
    config = json.load(open(f"{path}/config.json"))
    config["num_hidden_layers"] = 1
    config.pop("layer_types", None)
    json.dump(config, open(f"{path}/config.json", "w"))
    with pytest.raises(WeightLoadError, match=r"tensor of layer 1, but num_hidden_layers in config\.json is 1"):
        LoadedModel(path, dtype="float32")


def test_pipeline_stage_skips_other_stages_layers_and_refuses_layers_past_the_last(tmp_path, monkeypatch):
    from qwenserve.config.engine_config import LoadConfig
    from qwenserve.distributed.pipeline import PipelineParallel
    from qwenserve.model.loader.model_loader import WeightLoadError, load_model
    from qwenserve.model.loader.resolve import resolve_model
    hf = tiny_qwen3(seed=22, num_hidden_layers=3)
    whole = resolve_model(LoadConfig(model=save_gguf(hf, str(tmp_path / "three.gguf"), "F32"), dtype="float32"))
    first_stage = PipelineParallel(rank=0, size=2, layer_partition=(2, 1))
    model = load_model(whole, pp=first_stage)  # layer 2's tensors: the second stage's, skipped
    assert (model.model.start_layer, model.model.end_layer) == (0, 2)
    deep = save_gguf_edited(monkeypatch, hf, str(tmp_path / "deep.gguf"), keys={"{arch}.block_count": 2})
    resolved = resolve_model(LoadConfig(model=deep, dtype="float32"))
    with pytest.raises(WeightLoadError, match="tensor of layer 2, but GGUF metadata qwen3.block_count is 2"):
        load_model(resolved, pp=PipelineParallel(rank=0, size=2, layer_partition=(1, 1)))


def test_gguf_yarn_attn_factor_is_hf_attention_factor(tmp_path, monkeypatch):
    """convert_hf_to_gguf writes rope_scaling's attention_factor as rope.scaling.yarn_attn_factor: the file runs
    as HF runs the checkpoint it came from, with that magnitude in place of 0.1 ln(factor) + 1."""
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                attention_factor=0.8)
    hf = tiny_qwen3(seed=7, max_position_embeddings=128, rope_parameters=rope)
    path = save_gguf_edited(monkeypatch, hf, str(tmp_path / "yarn.gguf"),
                            keys={"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
                                  "{arch}.rope.scaling.original_context_length": 32,
                                  "{arch}.rope.scaling.yarn_attn_factor": 0.8})
    ours = LoadedModel(path, dtype="float32")
    assert ours.config.rope_scaling["attention_factor"] == pytest.approx(0.8)
    ids = [(i * 37) % 300 for i in range(80)]  # past original_context_length: the scaled frequencies matter
    with torch.no_grad():
        torch.testing.assert_close(full_logits(ours.model, ids), hf(torch.tensor([ids])).logits[0],
                                   atol=2e-5, rtol=1e-4)
        prompt_ours, prompt_hf = ids[:60], ids[:60]
        for _ in range(8):  # greedy continuation, token by token
            prompt_ours.append(int(full_logits(ours.model, prompt_ours)[-1].argmax()))
            prompt_hf.append(int(hf(torch.tensor([prompt_hf])).logits[0, -1].argmax()))
    assert prompt_ours == prompt_hf


def test_gguf_head_width_keys_must_agree():
    from qwenserve.config.errors import ConfigError
    from qwenserve.model.loader.checkpoint import config_from_gguf
    assert config_from_gguf(qwen3_metadata(**{"rope.dimension_count": 32})).head_dim == 32
    with pytest.raises(ConfigError, match=r"qwen3\.rope\.dimension_count \(16\) differs from "
                                          r"qwen3\.attention\.key_length \(32\)"):
        config_from_gguf(qwen3_metadata(**{"rope.dimension_count": 16}))
    with pytest.raises(ConfigError, match=r"qwen3\.attention\.value_length \(16\) differs from "
                                          r"qwen3\.attention\.key_length \(32\)"):
        config_from_gguf(qwen3_metadata(**{"attention.value_length": 16}))
    # without key_length the head width is embedding_length / head_count (16)
    with pytest.raises(ConfigError, match=r"qwen3\.rope\.dimension_count \(32\) differs from the head width"):
        config_from_gguf(qwen3_metadata(**{"attention.key_length": None, "attention.value_length": None,
                                           "rope.dimension_count": 32}))


@pytest.mark.parametrize("key, value", [("attention.layer_norm_rms_epsilon", "1e-6x"), ("rope.freq_base", "1e6"),
                                        ("attention.layer_norm_rms_epsilon", True)])
def test_gguf_non_numeric_metadata_names_key_and_value(key, value):
    from qwenserve.config.errors import ConfigError
    from qwenserve.model.loader.checkpoint import config_from_gguf
    with pytest.raises(ConfigError, match=rf"GGUF metadata qwen3\.{key} must be a number, got {value!r}"):
        config_from_gguf(qwen3_metadata(**{key: value}))


def test_gguf_metadata_error_names_the_file(tmp_path, monkeypatch):
    from qwenserve.config.errors import ConfigError
    path = save_gguf_edited(monkeypatch, tiny_qwen3(seed=21), str(tmp_path / "eps.gguf"),
                            keys={"{arch}.attention.layer_norm_rms_epsilon": "1e-6x"})
    with pytest.raises(ConfigError, match=rf"^{path}: GGUF metadata qwen3\.attention\.layer_norm_rms_epsilon "
                                          r"must be a number, got '1e-6x'"):
        GGUFCheckpoint(path)


def test_gguf_config_checks_name_the_gguf_key():
    from qwenserve.config.errors import ConfigError
    from qwenserve.model.loader.checkpoint import config_from_gguf
    with pytest.raises(ConfigError, match=r"head_dim must be a positive even integer, got 31 "
                                          r"\(GGUF key qwen3\.attention\.key_length\)"):
        config_from_gguf(qwen3_metadata(**{"attention.key_length": 31, "attention.value_length": None}))
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not a multiple of num_key_value_heads "
                                          r"\(3\) \(GGUF key qwen3\.attention\.head_count\)"):
        config_from_gguf(qwen3_metadata(**{"attention.head_count_kv": 3}))


def moe_gguf_metadata(tmp_path, kind: str, **overrides) -> tuple[dict, frozenset[str]]:
    from test_moe import tiny_moe
    file = GGUFFile(save_gguf(tiny_moe(kind, seed=31, **overrides), str(tmp_path / f"{kind}.gguf"), "F32"))
    return file.metadata, frozenset(file.tensors)


def test_gguf_shared_expert_errors_say_what_is_wrong(tmp_path):
    from qwenserve.config.errors import ConfigError
    from qwenserve.model.loader.checkpoint import config_from_gguf
    md, names = moe_gguf_metadata(tmp_path, "qwen2_moe")
    with pytest.raises(ConfigError, match=r"GGUF layer 0 has its shared expert's gate/up/down tensors .* but not "
                                          r"the shared expert's gate tensor blk\.0\.ffn_gate_inp_shexp\.weight"):
        config_from_gguf(md, frozenset(n for n in names if "ffn_gate_inp_shexp" not in n))
    md, names = moe_gguf_metadata(tmp_path, "qwen3_moe", norm_topk_prob=True)
    shared = {f"blk.0.ffn_{part}_shexp.weight" for part in ("gate", "up", "down", "gate_inp")}
    with pytest.raises(ConfigError, match=r"GGUF tensor blk\.0\.ffn_\w+_shexp\.weight belongs to a shared expert, "
                                          r"but Qwen3MoeForCausalLM \(qwen3moe\) has no shared expert"):
        config_from_gguf(md, names | shared)
    with pytest.raises(ConfigError, match=r"qwen3moe\.expert_used_count \(8\) is more than qwen3moe\.expert_count "
                                          r"\(6\)"):
        config_from_gguf({**md, "qwen3moe.expert_used_count": 8}, names)

"""`bench shaped-gguf`: Qwen2.5-, Qwen3- and MoE-shaped GGUF files with random weights in llama.cpp's Q4_K_M type
mix.
Reduced shapes are written with a tiny tokenizer (quick) and with the bundled one (slow); the real shapes' type
plans are checked without writing them. The expected types are spelled out here layer by layer, from llama.cpp's
rule (attn_v and ffn_down in Q6_K on the first and last eighth of the layers and every third one between, the LM
head in Q6_K, the embedding in Q6_K where it is the LM head), not computed by the code under test."""
import dataclasses
import json
import math
import os
import subprocess
import sys
from collections import Counter

import gguf
import numpy as np
import pytest
import torch
from helpers import save_gguf, tiny_hf_model

from qwenserve import LLM, SamplingParams
from qwenserve.benchmarks.shaped_gguf import SHAPES, ModelShape, tensor_plan, write_shaped_gguf
from qwenserve.entrypoints.cli.main import main
from qwenserve.model.loader.gguf_file import GGUFFile

# layers whose attn_v and ffn_down llama.cpp's Q4_K_M gives Q6_K, by layer count (worked out by hand)
MORE_BITS = {
    4: {2, 3},  # n/8 = 0, 7n/8 = 3; (i - 0) % 3 == 2 picks 2
    16: {0, 1, 4, 7, 10, 13, 14, 15},  # n/8 = 2, 7n/8 = 14
    28: {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27},  # n/8 = 3, 7n/8 = 24
    36: {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35},  # n/8 = 4, 7n/8 = 31
}
SMALL = ModelShape("tiny", hidden_size=256, num_layers=16, num_heads=4, num_kv_heads=2, intermediate_size=512,
                   tied_embeddings=True)
SMALL_UNTIED = ModelShape("tiny", hidden_size=256, num_layers=4, num_heads=2, num_kv_heads=1, intermediate_size=512,
                          tied_embeddings=False)
# Qwen3: heads of 128 over a hidden size of 256 (hidden / heads would be 64), as the published 0.6B has
SMALL_QWEN3 = ModelShape("tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                         tied_embeddings=False, architecture="qwen3", explicit_head_dim=128)
Q4_K, Q6_K, F32 = "Q4_K", "Q6_K", "F32"


def expected_types(shape: ModelShape, vocab: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (type, torch-order shape) of every tensor a Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms)
    Q4_K_M file of `shape` holds."""
    head_dim = shape.explicit_head_dim or shape.hidden_size // shape.num_heads
    h, ff = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * head_dim, shape.num_kv_heads * head_dim
    want = {"token_embd.weight": (Q6_K if shape.tied_embeddings else Q4_K, (vocab, h)),
            "output_norm.weight": (F32, (h,))}
    if not shape.tied_embeddings:
        want["output.weight"] = (Q6_K, (vocab, h))
    for i in range(shape.num_layers):
        more = Q6_K if i in MORE_BITS[shape.num_layers] else Q4_K
        want |= {f"blk.{i}.attn_q.weight": (Q4_K, (q, h)), f"blk.{i}.attn_k.weight": (Q4_K, (kv, h)),
                 f"blk.{i}.attn_v.weight": (more, (kv, h)), f"blk.{i}.attn_output.weight": (Q4_K, (h, q)),
                 f"blk.{i}.ffn_gate.weight": (Q4_K, (ff, h)), f"blk.{i}.ffn_up.weight": (Q4_K, (ff, h)),
                 f"blk.{i}.ffn_down.weight": (more, (h, ff)),
                 f"blk.{i}.attn_norm.weight": (F32, (h,)), f"blk.{i}.ffn_norm.weight": (F32, (h,))}
        if shape.architecture == "qwen2":
            want |= {f"blk.{i}.attn_q.bias": (F32, (q,)), f"blk.{i}.attn_k.bias": (F32, (kv,)),
                     f"blk.{i}.attn_v.bias": (F32, (kv,))}
        else:
            want |= {f"blk.{i}.attn_q_norm.weight": (F32, (head_dim,)),
                     f"blk.{i}.attn_k_norm.weight": (F32, (head_dim,))}
    return want


def read_with_gguf(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """gguf's own reader (not ours): name -> (type, torch-order shape)."""
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}


@pytest.fixture(scope="module")
def tiny_tokenizer_gguf(tmp_path_factory):
    """A qwen2 GGUF with a 320-token byte-level BPE: the tokenizer the quick tests copy."""
    return save_gguf(tiny_hf_model(seed=5), str(tmp_path_factory.mktemp("src") / "tokenizer.gguf"))


@pytest.fixture(scope="module")
def small_file(tiny_tokenizer_gguf, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("shaped") / "small.gguf")
    write_shaped_gguf(SMALL, path, seed=3, tokenizer_gguf=tiny_tokenizer_gguf)
    return path


@pytest.mark.parametrize("shape", [SMALL, SMALL_UNTIED, SMALL_QWEN3], ids=["tied", "untied", "qwen3"])
def test_every_tensor_has_the_q4_k_m_type_and_shape(shape, tiny_tokenizer_gguf, tmp_path):
    path = str(tmp_path / "m.gguf")
    result = write_shaped_gguf(shape, path, seed=1, tokenizer_gguf=tiny_tokenizer_gguf)
    want = expected_types(shape, vocab=320)
    got = read_with_gguf(path)
    assert got == want
    assert result["tensor_types"] == dict(Counter(t for t, _ in want.values()))
    q6 = sum(t == Q6_K for t, _ in want.values())
    assert q6 == 2 * len(MORE_BITS[shape.num_layers]) + 1  # v and down on those layers, and the LM head


@pytest.mark.parametrize("name", ["1.5b", "3b", "7b", "qwen3-1.7b", "qwen3-8b"])
def test_the_real_shapes_plan_the_q4_k_m_types(name):
    shape = SHAPES[name]
    plan = {t.name: (t.ggml_type.name, t.shape) for t in tensor_plan(shape, vocab_size=151936)}
    assert plan == expected_types(shape, vocab=151936)
    weights = sum(math.prod(t.shape) for t in tensor_plan(shape, 151936) if len(t.shape) == 2)
    # the published parameter counts: 1.54B, 3.09B, 7.62B, Qwen3 1.7B (2.03B with its embedding) and 8.2B (an
    # untied model counts its LM head)
    assert round(weights / 1e9, 1) == {"1.5b": 1.5, "3b": 3.1, "7b": 7.6, "qwen3-1.7b": 1.7, "qwen3-8b": 8.2}[name]


def test_metadata_is_the_sources_with_the_shape_and_name_replaced(small_file, tiny_tokenizer_gguf):
    written, source = GGUFFile(small_file).metadata, GGUFFile(tiny_tokenizer_gguf).metadata
    for key, value in source.items():
        if key.startswith("tokenizer.") or key in ("general.architecture", "general.alignment"):
            assert written[key] == value, key
    assert written["qwen2.block_count"] == 16 and written["qwen2.embedding_length"] == 256
    assert written["qwen2.feed_forward_length"] == 512 and written["qwen2.context_length"] == 32768
    assert written["qwen2.attention.head_count"] == 4 and written["qwen2.attention.head_count_kv"] == 2
    assert written["qwen2.rope.freq_base"] == 1e6
    assert written["qwen2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert written["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert "random weights" in written["general.name"]


def test_weights_have_a_trained_models_spread(small_file):
    f = GGUFFile(small_file)
    for name in ("blk.0.ffn_up.weight", "blk.0.attn_v.weight", "token_embd.weight"):  # Q4_K, Q6_K, Q6_K
        info = f.tensors[name]
        w = gguf.quants.dequantize(f.raw(name).reshape(info.shape[0], -1), info.ggml_type)
        assert np.isfinite(w).all()
        assert 0.018 < w.std() < 0.022, (name, w.std())
        assert abs(w.mean()) < 0.002, (name, w.mean())


def test_the_same_seed_writes_the_same_bytes(small_file, tiny_tokenizer_gguf, tmp_path):
    again, other = str(tmp_path / "again.gguf"), str(tmp_path / "other.gguf")
    write_shaped_gguf(SMALL, again, seed=3, tokenizer_gguf=tiny_tokenizer_gguf)
    write_shaped_gguf(SMALL, other, seed=4, tokenizer_gguf=tiny_tokenizer_gguf)
    first = open(small_file, "rb").read()
    assert open(again, "rb").read() == first
    assert open(other, "rb").read() != first and len(open(other, "rb").read()) == len(first)


def greedy_with_logits(path: str, prompt):
    llm = LLM(path, quantization="gguf", dtype="bfloat16", kv_cache_memory="16MiB", record_logits=True)
    assert llm.engine.resolved_model.quantization == "gguf"
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
    return llm, out


def test_qwenserve_runs_the_file_on_its_blocks(ops, small_file):
    llm, out = greedy_with_logits(small_file, {"prompt_token_ids": [5, 77, 120, 9]})
    assert llm.engine.resolved_model.config.tie_word_embeddings  # no output.weight: the head is the embedding
    assert len(out.token_ids) == 4 and len(out.logits) == 4
    for token, logits in zip(out.token_ids, out.logits):
        assert torch.isfinite(logits).all()
        assert logits.std() > 0.05  # random weights give spread logits, not a collapsed or zeroed output
        assert token == int(logits.argmax())


_LOAD_PEAK = r"""
import json, sys
from qwenserve.model.loader.model_loader import LoadedModel

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the present size
before = status("VmRSS")
loaded = LoadedModel(sys.argv[1], dtype="bfloat16", quantization="gguf")
print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS")}))
"""


LOAD_PEAK_SHAPES = {
    "dense": ModelShape("tiny", hidden_size=1024, num_layers=12, num_heads=8, num_kv_heads=2, intermediate_size=4096,
                        tied_embeddings=True),  # about 110 MB
    # the experts' blocks stacked per layer for ggml_moe, never dequantized: about 90 MB
    "qwen3moe": ModelShape("tiny", hidden_size=1024, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=4096,
                           tied_embeddings=False, architecture="qwen3moe", explicit_head_dim=128, num_experts=16,
                           num_experts_used=4, expert_intermediate_size=512),
}


@pytest.mark.multiproc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads and resets /proc/self/status's VmHWM")
@pytest.mark.parametrize("kind", sorted(LOAD_PEAK_SHAPES))
def test_loading_peaks_near_the_weights_not_at_twice_them(ops, tiny_tokenizer_gguf, tmp_path, kind):
    # the blocks are copied into the decode layout at load; the file's pages read for that must leave memory as
    # each layer is done, or the peak holds the whole file beside its copy
    path = str(tmp_path / "load-peak.gguf")
    write_shaped_gguf(LOAD_PEAK_SHAPES[kind], path, seed=1, tokenizer_gguf=tiny_tokenizer_gguf)
    size = os.path.getsize(path)
    result = subprocess.run([sys.executable, "-c", _LOAD_PEAK, path], capture_output=True, text=True, timeout=600,
                            env=os.environ | {"PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    held, peak = m["after"] - m["before"], m["peak"] - m["before"]
    assert held > 0.8 * size, m  # the weights themselves are resident once loaded
    assert peak - held < 0.25 * size, m  # at most a layer or two's pages beyond them at any time


def small_without_tokenizer(tmp_path) -> str:
    path = str(tmp_path / "no-tokenizer.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_shapes_and_sources_are_named(tiny_tokenizer_gguf, tmp_path, small_file):
    with pytest.raises(ValueError, match="hidden_size 896 is not a multiple of 256"):
        ModelShape("x", 896, 2, 14, 2, 4864, True)
    with pytest.raises(ValueError, match="num_heads 12 is not a multiple of num_kv_heads 5"):
        ModelShape("x", 1536, 2, 12, 5, 8960, True)
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        ModelShape("x", 256, 0, 2, 1, 512, True)
    with pytest.raises(FileExistsError, match="exists; pass --overwrite"):
        write_shaped_gguf(SMALL, small_file, tokenizer_gguf=tiny_tokenizer_gguf)
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        write_shaped_gguf(SMALL, str(tmp_path / "x.gguf"), seed=-1, tokenizer_gguf=tiny_tokenizer_gguf)
    with pytest.raises(ValueError, match="--tokenizer-gguf .*missing.gguf is not a file"):
        write_shaped_gguf(SMALL, str(tmp_path / "x.gguf"), tokenizer_gguf=str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="no tokenizer"):
        write_shaped_gguf(SMALL, str(tmp_path / "x.gguf"), tokenizer_gguf=small_without_tokenizer(tmp_path))
    assert main(["bench", "shaped-gguf", "--shape", "1.5b", "--output", str(tmp_path / "x.bin")]) == 2
    assert main(["bench", "shaped-gguf", "--shape", "1.5b", "--output", small_file,
                 "--tokenizer-gguf", tiny_tokenizer_gguf]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["no-tokenizer.gguf"]  # nothing left behind


@pytest.mark.slow
def test_with_the_bundled_tokenizer_it_loads_and_generates(ops, tmp_path):
    from qwenserve.model.loader.bundled import bundled_model_path
    shape = ModelShape("tiny", hidden_size=256, num_layers=4, num_heads=2, num_kv_heads=1, intermediate_size=512,
                       tied_embeddings=True)
    path = str(tmp_path / "bundled-tokenizer.gguf")
    write_shaped_gguf(shape, path, seed=0)
    bundled = GGUFFile(bundled_model_path())
    written = GGUFFile(path)
    for key, value in bundled.metadata.items():
        if key.startswith("tokenizer."):
            assert written.metadata[key] == value and written.metadata_types[key] == bundled.metadata_types[key], key
    assert read_with_gguf(path) == expected_types(shape, vocab=151936)
    _, out = greedy_with_logits(path, "def fibonacci(n):")
    assert len(out.token_ids) == 4 and all(torch.isfinite(logits).all() for logits in out.logits)
    assert isinstance(out.text, str)


def test_a_qwen3_file_keeps_no_qwen2_keys_and_runs(ops, tiny_tokenizer_gguf, tmp_path):
    path = str(tmp_path / "qwen3.gguf")
    write_shaped_gguf(SMALL_QWEN3, path, seed=2, tokenizer_gguf=tiny_tokenizer_gguf)
    written = GGUFFile(path).metadata
    assert written["general.architecture"] == "qwen3" and not [k for k in written if k.startswith("qwen2.")]
    assert written["qwen3.attention.key_length"] == written["qwen3.attention.value_length"] == 128
    assert written["qwen3.embedding_length"] == 256 and written["qwen3.attention.head_count"] == 4
    llm, out = greedy_with_logits(path, {"prompt_token_ids": [5, 77, 120, 9]})
    config = llm.engine.resolved_model.config
    assert (config.architectures[0], config.head_dim, config.attention_bias) == ("Qwen3ForCausalLM", 128, False)
    for token, logits in zip(out.token_ids, out.logits):
        assert torch.isfinite(logits).all() and logits.std() > 0.05 and token == int(logits.argmax())


# --- mixture of experts: qwen3moe (Qwen3-30B-A3B) and qwen2moe (Qwen1.5-MoE-A2.7B) ---
# Beside attn_v and ffn_down's Q6_K layers (MORE_BITS), llama.cpp's rule for these: the category is a name
# substring, so ffn_down_exps and ffn_down_shexp are ffn_down tensors (Q6_K on the same layers); the router
# ffn_gate_inp stays F32, as do 1-D tensors; a row length (last dimension) that is not a multiple of 256 falls back,
# Q4_K -> Q5_0 and Q6_K -> Q8_0 (Qwen1.5-MoE's expert width 1408, and 384 in the reduced shapes).
MORE_BITS |= {
    24: {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23},  # n/8 = 3, 7n/8 = 21
    48: {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47},  # n/8 = 6, 7n/8 = 42
}
SMALL_QWEN3_MOE = ModelShape("tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                             intermediate_size=512, tied_embeddings=False, architecture="qwen3moe",
                             explicit_head_dim=128, num_experts=4, num_experts_used=2, expert_intermediate_size=384)
SMALL_QWEN2_MOE = ModelShape("tiny", hidden_size=256, num_layers=4, num_heads=2, num_kv_heads=2,
                             intermediate_size=512, tied_embeddings=False, architecture="qwen2moe", num_experts=4,
                             num_experts_used=2, expert_intermediate_size=384, shared_expert_intermediate_size=512)


def expected_moe_types(arch: str, layers: int, h: int, heads: int, kv_heads: int, head_dim: int, experts: int,
                       expert_ff: int, shared_ff: int, vocab: int, fallback_down: bool, fallback_shared: bool = False):
    """name -> (type, torch-order shape) of a Q4_K_M MoE file, from the arguments alone. fallback_down: the experts'
    down rows (expert_ff long) are not whole 256-blocks, so Q5_0 / Q8_0 instead of Q4_K / Q6_K."""
    q, kv = heads * head_dim, kv_heads * head_dim
    want = {"token_embd.weight": (Q4_K, (vocab, h)), "output.weight": (Q6_K, (vocab, h)),
            "output_norm.weight": (F32, (h,))}
    for i in range(layers):
        more = i in MORE_BITS[layers]
        down = {(False, False): Q4_K, (True, False): Q6_K, (False, True): "Q5_0", (True, True): "Q8_0"}
        want |= {f"blk.{i}.attn_q.weight": (Q4_K, (q, h)), f"blk.{i}.attn_k.weight": (Q4_K, (kv, h)),
                 f"blk.{i}.attn_v.weight": (Q6_K if more else Q4_K, (kv, h)),
                 f"blk.{i}.attn_output.weight": (Q4_K, (h, q)),
                 f"blk.{i}.attn_norm.weight": (F32, (h,)), f"blk.{i}.ffn_norm.weight": (F32, (h,)),
                 f"blk.{i}.ffn_gate_inp.weight": (F32, (experts, h)),
                 f"blk.{i}.ffn_gate_exps.weight": (Q4_K, (experts, expert_ff, h)),
                 f"blk.{i}.ffn_up_exps.weight": (Q4_K, (experts, expert_ff, h)),
                 f"blk.{i}.ffn_down_exps.weight": (down[more, fallback_down], (experts, h, expert_ff))}
        if arch == "qwen2moe":
            want |= {f"blk.{i}.attn_q.bias": (F32, (q,)), f"blk.{i}.attn_k.bias": (F32, (kv,)),
                     f"blk.{i}.attn_v.bias": (F32, (kv,)),
                     f"blk.{i}.ffn_gate_shexp.weight": (Q4_K, (shared_ff, h)),
                     f"blk.{i}.ffn_up_shexp.weight": (Q4_K, (shared_ff, h)),
                     f"blk.{i}.ffn_down_shexp.weight": (down[more, fallback_shared], (h, shared_ff)),
                     f"blk.{i}.ffn_gate_inp_shexp.weight": (F32, (h,))}
        else:
            want |= {f"blk.{i}.attn_q_norm.weight": (F32, (head_dim,)),
                     f"blk.{i}.attn_k_norm.weight": (F32, (head_dim,))}
    return want


def test_the_real_moe_shapes_plan_the_q4_k_m_types():
    # Qwen3-30B-A3B: 48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128 experts of width 768, no shared expert
    plan = {t.name: (t.ggml_type.name, t.shape) for t in tensor_plan(SHAPES["qwen3-30b-a3b"], 151936)}
    assert plan == expected_moe_types("qwen3moe", 48, 2048, 32, 4, 128, 128, 768, 0, 151936, fallback_down=False)
    # Qwen1.5-MoE-A2.7B: 24 layers, hidden 2048, 16 heads of 128 (MHA), 60 experts of width 1408 (not a multiple
    # of 256: the experts' down rows fall back), a shared expert of 5632
    plan = {t.name: (t.ggml_type.name, t.shape) for t in tensor_plan(SHAPES["qwen1.5-moe-a2.7b"], 151936)}
    assert plan == expected_moe_types("qwen2moe", 24, 2048, 16, 16, 128, 60, 1408, 5632, 151936, fallback_down=True)
    assert Counter(t for t, _ in plan.values())["Q5_0"] == 12 and Counter(t for t, _ in plan.values())["Q8_0"] == 12
    # the published totals: 30.5B and 14.3B parameters (with the embedding and the untied LM head)
    for name, billions in (("qwen3-30b-a3b", 30.5), ("qwen1.5-moe-a2.7b", 14.3)):
        weights = sum(math.prod(t.shape) for t in tensor_plan(SHAPES[name], 151936))
        assert round(weights / 1e9, 1) == billions, name


@pytest.mark.parametrize("shape", [SMALL_QWEN3_MOE, SMALL_QWEN2_MOE], ids=["qwen3moe", "qwen2moe"])
def test_a_moe_file_reads_back_and_runs(ops, shape, tiny_tokenizer_gguf, tmp_path):
    path = str(tmp_path / "moe.gguf")
    write_shaped_gguf(shape, path, seed=2, tokenizer_gguf=tiny_tokenizer_gguf)
    assert read_with_gguf(path) == expected_moe_types(
        shape.architecture, 4, 256, shape.num_heads, shape.num_kv_heads, 128, 4, 384, 512, 320, fallback_down=True)
    f = GGUFFile(path)
    arch = shape.architecture
    assert f.metadata["general.architecture"] == arch and not [k for k in f.metadata if k.startswith("qwen2.")]
    assert (f.metadata[f"{arch}.expert_count"], f.metadata[f"{arch}.expert_used_count"],
            f.metadata[f"{arch}.expert_feed_forward_length"]) == (4, 2, 384)
    assert f.metadata.get(f"{arch}.expert_shared_feed_forward_length") == (512 if arch == "qwen2moe" else None)
    # the fallback blocks keep the others' spread: Q5_0 on layer 0, Q8_0 on layer 3 (a more-bits layer)
    for name in ("blk.0.ffn_down_exps.weight", "blk.3.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight"):
        info = f.tensors[name]
        w = gguf.quants.dequantize(f.raw(name).reshape(-1, info.nbytes // math.prod(info.shape[:-1])),
                                   info.ggml_type)
        assert np.isfinite(w).all() and 0.018 < w.std() < 0.022 and abs(w.mean()) < 0.002, (name, w.std())
    llm, out = greedy_with_logits(path, {"prompt_token_ids": [5, 77, 120, 9]})
    config = llm.engine.resolved_model.config
    assert config.architectures[0] == {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}[arch]
    assert (config.extra["num_experts"], config.extra["num_experts_per_tok"],
            config.extra["moe_intermediate_size"]) == (4, 2, 384)
    assert config.extra["shared_expert_intermediate_size"] == (512 if arch == "qwen2moe" else 0)
    assert config.attention_bias == (arch == "qwen2moe")
    assert len(out.token_ids) == 4
    for token, logits in zip(out.token_ids, out.logits):
        assert torch.isfinite(logits).all() and logits.std() > 0.05 and token == int(logits.argmax())


def test_layers_writes_the_first_n(tiny_tokenizer_gguf, tmp_path):
    path = str(tmp_path / "cut.gguf")
    assert main(["bench", "shaped-gguf", "--shape", "qwen3-30b-a3b", "--output", path, "--layers", "1",
                 "--tokenizer-gguf", tiny_tokenizer_gguf]) == 0
    f = GGUFFile(path)
    assert f.metadata["qwen3moe.block_count"] == 1
    assert {n.split(".")[1] for n in f.tensors if n.startswith("blk.")} == {"0"}
    assert f.tensors["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    for bad in ("0", "49", "-1"):
        assert main(["bench", "shaped-gguf", "--shape", "qwen3-30b-a3b", "--output", str(tmp_path / "x.gguf"),
                     "--layers", bad, "--tokenizer-gguf", tiny_tokenizer_gguf]) == 2
    with pytest.raises(ValueError, match="--layers must be an integer from 1 to the shape's 24 layers, got 25"):
        write_shaped_gguf(SHAPES["qwen1.5-moe-a2.7b"], str(tmp_path / "x.gguf"), layers=25,
                          tokenizer_gguf=tiny_tokenizer_gguf)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


def test_bad_moe_shapes_are_named():
    with pytest.raises(ValueError, match="expert_intermediate_size 400 is not a multiple of 32"):
        dataclasses.replace(SMALL_QWEN3_MOE, expert_intermediate_size=400)
    with pytest.raises(ValueError, match="num_experts_used 5 exceeds num_experts 4"):
        dataclasses.replace(SMALL_QWEN3_MOE, num_experts_used=5)
    with pytest.raises(ValueError, match="qwen3moe shape has no shared expert"):
        dataclasses.replace(SMALL_QWEN3_MOE, shared_expert_intermediate_size=512)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size must be a positive integer"):
        dataclasses.replace(SMALL_QWEN2_MOE, shared_expert_intermediate_size=0)
    with pytest.raises(ValueError, match="qwen2 shape has no experts"):
        ModelShape("x", 256, 2, 2, 1, 512, True, num_experts=4)

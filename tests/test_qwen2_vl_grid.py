"""Qwen2-VL and Qwen2.5-VL against transformers over a grid of image cases, on tiny random checkpoints made with its
own classes, four vision configs: each family as the published models shape it but small (Qwen2.5-VL with windows of
56 pixels and blocks 1 and 3 over the whole image), and each with non-default fields (Qwen2-VL with 16-pixel patches
and 3-frame temporal patches; Qwen2.5-VL with 3x3 spatial merge, windows of 126 pixels, blocks 0 and 2 whole).
Images are square, wide, tall, one row of merged tokens, smaller than min_pixels (scaled up), larger than max_pixels
(scaled down), 1, 2 and 3 to a prompt with text between, around and not at all between them. For each case: the
vision tower's rows equal transformers' (float32 rounding), M-RoPE positions equal its get_rope_index exactly,
greedy tokens equal its generate, batched with text-only prompts and again from the prefix cache; and through the
OpenAI server with the openai client, data: and http:// URLs."""
import http.server
import io
import threading

import numpy as np
import openai
import pytest
import torch
from helpers import live_server
from transformers import AutoTokenizer
from vl_helpers import (IMAGE, data_url, hf_greedy, hf_image_processor, random_image, save_hf_vl_dir,
                        tiny_hf_vl_model)

from qwenserve import LLM, SamplingParams
from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import ModelConfig
from qwenserve.engine.async_engine import AsyncLLMEngine
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.openai.api_server import build_app
from qwenserve.model.layers.rotary import mrope_positions
from qwenserve.model.models.qwen2_vl_processor import Qwen2VLProcessor

MAX_PIXELS = 28 * 28 * 256  # up to 256 tokens an image: small enough to run quickly, large enough to scale down
# (kind, vision_config fields, image processor fields that must agree with them)
CONFIGS = {
    "qwen2_vl": ("qwen2_vl", {}, {}),
    "qwen2_vl_p16_t3": ("qwen2_vl", {"patch_size": 16, "temporal_patch_size": 3},
                        {"patch_size": 16, "temporal_patch_size": 3}),
    "qwen2_5_vl_w56": ("qwen2_5_vl", {"window_size": 56, "fullatt_block_indexes": [1, 3]}, {}),
    "qwen2_5_vl_m3_w126": ("qwen2_5_vl", {"depth": 3, "spatial_merge_size": 3, "window_size": 126,
                                          "fullatt_block_indexes": [0, 2]}, {"merge_size": 3}),
}
# (height, width)
SIZES = {"square": (224, 224), "wide": (160, 320), "tall": (320, 160), "row": (30, 600), "small": (12, 20),
         "big": (700, 500)}
CASES = [  # (prompt, images in order)
    (f"look {IMAGE} at this", ["square"]),
    (f"{IMAGE} what is it?", ["wide"]),
    (f"describe {IMAGE}", ["tall"]),
    (f"a {IMAGE} b", ["small"]),
    (f"compare {IMAGE} with {IMAGE} please", ["square", "wide"]),
    (f"{IMAGE}{IMAGE} both", ["tall", "small"]),
    (f"a {IMAGE} b {IMAGE} c {IMAGE} d", ["wide", "tall", "row"]),
    (f"{IMAGE} then {IMAGE}{IMAGE}", ["big", "small", "square"]),
]
TEXT_ONLY = ["a text-only prompt between them", "and another"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=list(CONFIGS))
def vl(request, tmp_path_factory):
    """(HF model, its image processor, checkpoint directory, images by name)."""
    kind, vision, processing = CONFIGS[request.param]
    hf = tiny_hf_vl_model(kind, seed=2, vision=vision)
    processor = hf_image_processor(max_pixels=MAX_PIXELS, **processing)
    path = save_hf_vl_dir(hf, str(tmp_path_factory.mktemp(request.param)), processor)
    images = {name: random_image(h, w, seed=i) for i, (name, (h, w)) in enumerate(SIZES.items())}
    return hf, processor, path, images


@pytest.fixture(scope="module")
def llm(vl):
    return LLM(vl[2], dtype="float32", kv_cache_memory="64MiB", block_size=8)


def _grids(processor, images) -> torch.Tensor:
    return processor(images=images, return_tensors="pt")["image_grid_thw"]


def test_vision_tower_rows_equal_transformers(vl, llm):
    """Every case's images in one tower call: each image's rows are HF's, whatever its neighbours."""
    hf, processor, _, images = vl
    tower = llm.engine.executor.worker.model_runner.model
    for _, names in CASES:
        ref = processor(images=[images[n] for n in names], return_tensors="pt")
        grids = [tuple(g) for g in ref["image_grid_thw"].tolist()]
        with torch.no_grad():
            expected = torch.cat(hf.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output)
            ours = tower.embed_images(ref["pixel_values"], grids)
        assert ours.shape == expected.shape, names
        torch.testing.assert_close(ours, expected, atol=3e-5, rtol=1e-5, msg=lambda m: f"{names}: {m}")


def test_positions_equal_get_rope_index(vl):
    """The engine's placeholder expansion and M-RoPE positions against get_rope_index, token for token."""
    hf, processor, path, images = vl
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    ours = Qwen2VLProcessor(config.vision, processor.to_dict())
    tok = AutoTokenizer.from_pretrained(path)
    pad = hf.config.image_token_id
    for text, names in CASES:
        processed = [ours.process(images[n]) for n in names]
        ids, offsets, _ = ours.expand_placeholders(tok.encode(text, add_special_tokens=False), processed)
        grids = _grids(processor, [images[n] for n in names])
        assert [p.grid for p in processed] == [tuple(g) for g in grids.tolist()]
        mm = (torch.tensor([ids]) == pad).int()
        expected, delta = hf.model.get_rope_index(torch.tensor([ids]), mm_token_type_ids=mm, image_grid_thw=grids)
        positions, our_delta = mrope_positions(len(ids), [(o, p.grid) for o, p in zip(offsets, processed)],
                                               config.vision.spatial_merge_size)
        assert np.array_equal(positions, expected[:, 0].numpy()), text
        assert our_delta == int(delta), text


def test_greedy_equals_transformers_batched_and_from_the_prefix_cache(vl, llm):
    """Every case and two text-only prompts in one generate call; then the same again, its image blocks found in the
    prefix cache, with the same tokens."""
    hf, processor, _, images = vl
    prompts = [{"prompt": text, "multi_modal_data": {"image": [images[n] for n in names]}} for text, names in CASES]
    prompts[2:2], prompts[5:5] = [TEXT_ONLY[0]], [TEXT_ONLY[1]]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, first):
        text, imgs = (prompt["prompt"], prompt["multi_modal_data"]["image"]) if isinstance(prompt, dict) \
            else (prompt, [])
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, tok, text, imgs, GREEDY.max_tokens, processor), text
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, a, b in zip(prompts, first, again):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids), prompt
        if isinstance(prompt, dict):
            assert b.num_cached_tokens >= len(b.prompt_token_ids) - 8, prompt  # all but the last block's


def test_openai_server_data_and_http_urls(vl):
    """Two images in one message and one in the next, as a data: URL and an http:// URL through the openai client:
    transformers' tokens."""
    hf, processor, path, images = vl
    buffer = io.BytesIO()
    images["tall"].save(buffer, format="PNG")
    body = buffer.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    media = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=media.serve_forever, daemon=True).start()
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32", kv_cache_memory="32MiB",
                                                               allowed_media_domains=["127.0.0.1"])))
    try:
        with live_server(build_app(engine, ["vl"])) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            messages = [
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(images["square"])}},
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{media.server_address[1]}/t.png"}},
                    {"type": "text", "text": "what differs?"}]},
                {"role": "assistant", "content": "nothing"},
                {"role": "user", "content": [{"type": "text", "text": "and this"},
                                             {"type": "image_url", "image_url": {"url": data_url(images["wide"])}}]}]
            reply = client.chat.completions.create(model="vl", messages=messages, temperature=0, logprobs=True,
                                                   max_tokens=GREEDY.max_tokens, extra_body={"ignore_eos": True})
    finally:
        engine.shutdown()
        media.shutdown()
    tok = engine.tokenizer
    text = (f"<|im_start|>user\n{IMAGE}and{IMAGE}what differs?<|im_end|>\n<|im_start|>assistant\nnothing<|im_end|>\n"
            f"<|im_start|>user\nand this{IMAGE}<|im_end|>\n<|im_start|>assistant\n")
    expected = hf_greedy(hf, tok, text, [images["square"], images["tall"], images["wide"]], GREEDY.max_tokens,
                         processor)
    # each token's text (the reply's text holds back a tiny vocabulary's incomplete UTF-8)
    assert [entry.token for entry in reply.choices[0].logprobs.content] == [tok.decode([t]) for t in expected]


def _vision(**fields) -> dict:
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "vocab_size": 320, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "image_token_id": 1, "video_token_id": 2, "vision_start_token_id": 3, "vision_end_token_id": 4,
            "vision_config": {"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                              "out_hidden_size": 64} | fields}


def test_vision_config_fields_as_transformers_reads_them():
    """Fields config.json leaves out take transformers' defaults; values the tower cannot run are startup errors
    naming the field."""
    import transformers
    vision = ModelConfig.from_hf_dict(_vision()).vision
    reference = transformers.Qwen2_5_VLVisionConfig()
    assert vision.fullatt_block_indexes == tuple(reference.fullatt_block_indexes)
    assert (vision.window_size, vision.tokens_per_second, vision.patch_size, vision.spatial_merge_size,
            vision.temporal_patch_size) == (reference.window_size, reference.tokens_per_second, reference.patch_size,
                                            reference.spatial_merge_size, reference.temporal_patch_size)
    assert ModelConfig.from_hf_dict(_vision(window_size=70, fullatt_block_indexes=[])).vision.window_tokens == 2
    for fields, message in [({"window_size": 20}, "window_size"), ({"fullatt_block_indexes": 1},
                                                                    "fullatt_block_indexes"),
                            ({"hidden_act": "gelu_fast"}, "hidden_act"), ({"patch_size": [14, 14]}, "patch_size"),
                            ({"head_dim": 8}, "head_dim")]:
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf_dict(_vision(**{"fullatt_block_indexes": [1]} | fields))

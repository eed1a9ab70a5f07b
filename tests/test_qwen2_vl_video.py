"""Video on tiny random Qwen2-VL and Qwen2.5-VL checkpoints: a video is its frames (no decoder here). Pixel values
equal to transformers' (its image processor's patches of each frame, laid out as its video processor's patchify
does: transformers' video processor itself needs torchvision, which is not installed), M-RoPE positions equal to
get_rope_index with second_per_grid_ts, and greedy tokens equal to transformers' generate for a video prompt and
for one mixing an image and a video; offline through generate and chat, and over HTTP as a video_url part whose
url is the list of frame URLs."""
import copy

import httpx
import numpy as np
import pytest
import torch
from helpers import live_server, wait_idle_and_clean
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vl_helpers import ARCHITECTURES, IMAGE, data_url, hf_image_processor, random_image, save_hf_vl_dir, \
    tiny_hf_vl_model

from qwenserve import LLM, SamplingParams
from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import RequestError
from qwenserve.config.model_config import ModelConfig
from qwenserve.engine.async_engine import AsyncLLMEngine
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.openai.api_server import build_app
from qwenserve.model.layers.rotary import mrope_positions
from qwenserve.model.models.qwen2_vl_processor import VIDEO_FPS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, \
    Qwen2VLProcessor

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 336x308 is a multiple of 28 within the video pixel bounds: the frames keep their size, so the reference's
# patches can come from transformers' image processor; 3 frames: the last is repeated to fill 2 temporal patches
FRAMES = [random_image(336, 308, seed=20 + i) for i in range(3)]


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def vl(request, tmp_path_factory):
    hf = tiny_hf_vl_model(request.param, seed=2)
    return request.param, hf, save_hf_vl_dir(hf, str(tmp_path_factory.mktemp(request.param)))


def reference_video(frames) -> tuple[torch.Tensor, list[int]]:
    """transformers' pixel values and grid of frames that need no resizing: each frame's patches from its image
    processor (which repeats a still frame over the temporal patch), consecutive frames in each patch's two
    temporal slots, the last frame repeated to an even count (its video processor's patchify)."""
    processor = Qwen2VLImageProcessorPil(min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS)
    frames = list(frames) + frames[-1:] * (len(frames) % 2)
    per_frame = [processor(images=[f], return_tensors="pt") for f in frames]
    t, (_, rows, cols) = len(frames) // 2, per_frame[0]["image_grid_thw"][0].tolist()
    slots = [p["pixel_values"].view(rows * cols, 3, 2, 14, 14) for p in per_frame]
    pairs = [torch.stack([slots[2 * j][:, :, 0], slots[2 * j + 1][:, :, 0]], dim=2) for j in range(t)]
    return torch.cat(pairs).reshape(t * rows * cols, -1), [t, rows, cols]


def hf_generate(hf, tokenizer, text: str, images: list, video: list | None, max_new_tokens: int,
                fps: float = VIDEO_FPS) -> list[int]:
    """transformers' generate for a prompt with images (its image processor) and one video (reference_video),
    placeholders expanded as its processor does, Qwen2.5-VL's frames spaced at fps."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    cfg, kwargs, grids = hf.config, {}, {}
    if images:
        processed = hf_image_processor()(images=images, return_tensors="pt")
        kwargs.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
        grids[cfg.image_token_id] = iter(processed["image_grid_thw"].tolist())
    if video is not None:
        pixels, grid = reference_video(video)
        kwargs.update(pixel_values_videos=pixels, video_grid_thw=torch.tensor([grid]))
        grids[cfg.video_token_id] = iter([grid])
        if "2_5" in type(hf).__name__:
            kwargs["second_per_grid_ts"] = torch.tensor([2 / fps])
    expanded, types = [], []
    for t in ids:
        n = int(np.prod(next(grids[t]))) // 4 if t in grids else 1
        expanded += [t] * n
        types += [{cfg.image_token_id: 1, cfg.video_token_id: 2}.get(t, 0)] * n
    input_ids = torch.tensor([expanded])
    config = copy.deepcopy(hf.generation_config)  # argmax every step, an end-of-sequence token too (ignore_eos)
    config.update(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[])
    with torch.no_grad():
        out = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                          mm_token_type_ids=torch.tensor([types]), **kwargs)
    return out[0, len(expanded):].tolist()


def test_video_pixels_equal_transformers(vl):
    _, hf, _ = vl
    ours = Qwen2VLProcessor(ModelConfig.from_hf_dict(hf.config.to_dict()).vision, hf_image_processor().to_dict(), {})
    for frames in (FRAMES, FRAMES[:2]):
        mine = ours.process_video(frames)
        pixels, grid = reference_video(frames)
        assert list(mine.grid) == grid == [2 if len(frames) == 3 else 1, 24, 22]
        assert mine.num_tokens == grid[0] * 24 * 22 // 4
        np.testing.assert_allclose(mine.pixel_values, pixels.numpy(), atol=2e-6, rtol=0)
    assert ours.process_video([data_url(f) for f in FRAMES]).content_hash == ours.process_video(FRAMES).content_hash
    with pytest.raises(RequestError, match="one size"):
        ours.process_video([FRAMES[0], random_image(60, 90)])


def test_video_pixel_limits_follow_the_checkpoint(vl, tmp_path):
    """As transformers loads them: processor_config.json's nested video_processor, else
    video_preprocessor_config.json, else the image settings (preprocessor_config.json), else the video processor's
    defaults; images from the nested image_processor, else preprocessor_config.json."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    from qwenserve.model.loader.checkpoint import _processor_configs
    _, hf, _ = vl
    vision = ModelConfig.from_hf_dict(hf.config.to_dict()).vision
    image_48, image_40 = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 48}, {"max_pixels": 28 * 28 * 40}
    cases = {  # files -> (image limits, video limits)
        "defaults": ({}, (56 * 56, 28 * 28 * 1280), (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)),
        "image only": ({"preprocessor_config.json": image_48}, (56 * 56, 28 * 28 * 48), (56 * 56, 28 * 28 * 48)),
        "video file": ({"preprocessor_config.json": image_48, "video_preprocessor_config.json":
                        {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}}},
                       (56 * 56, 28 * 28 * 48), (56 * 56, 28 * 28 * 64)),
        "nested": ({"preprocessor_config.json": image_48, "video_preprocessor_config.json": {"max_pixels": 7},
                    "processor_config.json": {"image_processor": image_40,
                                              "video_processor": {"max_pixels": 28 * 28 * 100}}},
                   (56 * 56, 28 * 28 * 40), (VIDEO_MIN_PIXELS, 28 * 28 * 100)),
    }
    for name, (files, image_limits, video_limits) in cases.items():
        directory = tmp_path / name.replace(" ", "_")
        directory.mkdir()
        for file, content in files.items():
            (directory / file).write_text(json.dumps(content))
        ours = Qwen2VLProcessor(vision, *_processor_configs(str(directory)))
        assert (ours.min_pixels, ours.max_pixels) == image_limits, name
        rows, cols = (side // 14 for side in hf_smart_resize(336, 308, 28, *video_limits))
        assert ours.process_video(FRAMES[:2]).grid == (1, rows, cols), name


def test_a_videos_frame_rate_sets_its_temporal_positions(vl):
    """(frames, {"fps": x}) offline and video_url.fps over HTTP: Qwen2.5-VL's frames spaced 2 / x seconds apart
    per temporal patch, as transformers' second_per_grid_ts; a rate that is not a positive number is refused."""
    kind, hf, path = vl
    processor = Qwen2VLProcessor(ModelConfig.from_hf_dict(hf.config.to_dict()).vision, {}, {})
    slow, default = processor.process_video((FRAMES, {"fps": 0.5})), processor.process_video(FRAMES)
    assert slow.content_hash != default.content_hash or kind == "qwen2_vl"
    assert default.content_hash == processor.process_video((FRAMES, {"fps": VIDEO_FPS})).content_hash
    for bad in (0, -1.0, float("nan"), "2", True):
        with pytest.raises(RequestError, match="fps must be a positive number"):
            processor.process_video((FRAMES, {"fps": bad}))
    if kind != "qwen2_5_vl":
        return
    llm = LLM(path, dtype="float32", kv_cache_memory="64MiB")
    tok = llm.get_tokenizer()
    text = f"watch {VIDEO} now"
    for fps in (1.0, 0.5, 4):
        out = llm.generate({"prompt": text, "multi_modal_data": {"video": (FRAMES, {"fps": fps})}}, GREEDY,
                           use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == hf_generate(hf, tok, text, [], FRAMES, GREEDY.max_tokens, fps), fps
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32", kv_cache_memory="64MiB")))
    try:
        with live_server(build_app(engine, ["vl"])) as url:
            def post(fps):
                video = {"type": "video_url", "video_url": {"url": [data_url(f) for f in FRAMES], "fps": fps}}
                return httpx.post(url + "/v1/chat/completions", timeout=60, json={
                    "model": "vl", "temperature": 0, "max_tokens": 6, "ignore_eos": True, "messages": [
                        {"role": "user", "content": [{"type": "text", "text": "watch "}, video,
                                                     {"type": "text", "text": " now"}]}]})
            chat_text = f"<|im_start|>user\nwatch {VIDEO} now<|im_end|>\n<|im_start|>assistant\n"
            response = post(1.0)
            assert response.status_code == 200, response.text
            want = hf_generate(hf, tok, chat_text, [], FRAMES, GREEDY.max_tokens, 1.0)
            assert response.json()["choices"][0]["message"]["content"] == tok.decode(want)
            bad = post("fast")
            assert bad.status_code == 400 and "fps must be a positive number" in bad.json()["error"]["message"]
            assert bad.json()["error"]["param"] == "messages[0].content[1]"
            wait_idle_and_clean(engine)
    finally:
        engine.shutdown()


def test_mrope_positions_with_a_video_equal_get_rope_index(vl):
    kind, hf, _ = vl
    cfg = hf.config
    ids = [5, cfg.vision_start_token_id] + [cfg.image_token_id] * 6 + [7, 8] + [cfg.video_token_id] * 24 + [9]
    types = torch.tensor([[{cfg.image_token_id: 1, cfg.video_token_id: 2}.get(t, 0) for t in ids]])
    kwargs = {"second_per_grid_ts": torch.tensor([0.7])} if kind == "qwen2_5_vl" else {}
    expected, delta = hf.model.get_rope_index(torch.tensor([ids]), mm_token_type_ids=types,
                                              image_grid_thw=torch.tensor([[1, 4, 6]]),
                                              video_grid_thw=torch.tensor([[3, 4, 8]]), **kwargs)
    interval = cfg.vision_config.tokens_per_second * 0.7 if kind == "qwen2_5_vl" else 1.0
    ours, our_delta = mrope_positions(len(ids), [(2, (1, 4, 6)), (10, (3, 4, 8), interval)], 2)
    assert np.array_equal(ours, expected[:, 0].numpy()) and our_delta == int(delta)


def test_greedy_with_video_equals_transformers_generate(vl):
    _, hf, path = vl
    llm = LLM(path, dtype="float32", kv_cache_memory="64MiB")
    tok = llm.get_tokenizer()
    image = random_image(60, 90, seed=3)
    cases = [(f"watch {VIDEO} now", [], FRAMES), (f"a {IMAGE} b {VIDEO} c", [image], FRAMES[:2])]
    prompts = [{"prompt": text, "multi_modal_data": {"video": video} | ({"image": images} if images else {})}
               for text, images, video in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, images, video), out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == hf_generate(hf, tok, text, images, video, GREEDY.max_tokens), text
    assert outs[0].prompt_token_ids.count(hf.config.video_token_id) == 264
    chat = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": "watch "}, {"type": "video_url", "video_url": {"url": [data_url(f) for f in FRAMES]}},
        {"type": "text", "text": " now"}]}], GREEDY, use_tqdm=False)[0]
    text = f"<|im_start|>user\nwatch {VIDEO} now<|im_end|>\n<|im_start|>assistant\n"
    assert list(chat.outputs[0].token_ids) == hf_generate(hf, tok, text, [], FRAMES, GREEDY.max_tokens)
    with pytest.raises(RequestError, match="1 videos"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"video": FRAMES}}, GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="no videos"):
        llm.generate(f"x {VIDEO}", GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("vl", ["qwen2_vl"], indirect=True)  # one architecture: the HTTP path is the same
def test_video_over_http_equals_offline(vl):
    _, _, path = vl
    frames = [data_url(f) for f in FRAMES]
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32", kv_cache_memory="64MiB",
                                                               limit_mm_per_prompt='{"video": 1}')))
    try:
        with live_server(build_app(engine, ["vl"])) as url:
            def post(*parts):
                return httpx.post(url + "/v1/chat/completions", timeout=60, json={
                    "model": "vl", "temperature": 0, "max_tokens": 6, "ignore_eos": True,
                    "messages": [{"role": "user", "content": list(parts)}]})
            video = {"type": "video_url", "video_url": {"url": frames}}
            response = post({"type": "text", "text": "watch "}, video, {"type": "text", "text": " now"})
            assert response.status_code == 200, response.text
            offline = LLM(path, dtype="float32", kv_cache_memory="64MiB").chat([{"role": "user", "content": [
                {"type": "text", "text": "watch "}, video, {"type": "text", "text": " now"}]}], GREEDY,
                use_tqdm=False)[0]
            body = response.json()
            assert body["choices"][0]["message"]["content"] == offline.outputs[0].text
            assert body["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
            for parts, words in (((video, video), "--limit-mm-per-prompt"),
                                 (({"type": "video_url", "video_url": {"url": frames[:1] + ["data:x"]}},),
                                  "(frame 1): a data: URL must be base64")):
                bad = post(*parts)
                assert bad.status_code == 400 and words in bad.json()["error"]["message"], bad.text
                assert bad.json()["error"]["param"] == f"messages[0].content[{len(parts) - 1}]"
            wait_idle_and_clean(engine)
    finally:
        engine.shutdown()


@pytest.mark.multiproc
@pytest.mark.parametrize("vl", ["qwen2_5_vl"], indirect=True)
@pytest.mark.parametrize("tp,pp,extra", [(2, 1, {}), (1, 2, dict(max_num_batched_tokens=64))])
def test_images_and_video_across_worker_processes(vl, tp, pp, extra):
    """Tensor parallel (every rank runs the tower) and pipeline parallel (the first stage runs it; chunks of 64
    tokens cut the video and image over steps in flight) give transformers' tokens."""
    _, hf, path = vl
    image = random_image(150, 100, seed=4)
    cases = [(f"a {IMAGE} b {VIDEO} c", [image], FRAMES), (f"watch {VIDEO} now", [], FRAMES[:2]),
             (f"just {IMAGE}", [image], None)]
    llm = LLM(path, dtype="float32", kv_cache_memory="64MiB", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              **extra)
    try:
        prompts = [{"prompt": text, "multi_modal_data": ({"video": video} if video else {}) |
                    ({"image": images} if images else {})} for text, images, video in cases]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        tok = llm.get_tokenizer()
        for (text, images, video), out in zip(cases, outs):
            assert list(out.outputs[0].token_ids) == hf_generate(hf, tok, text, images, video, GREEDY.max_tokens)
    finally:
        llm.engine.shutdown()


def test_compare_command_on_a_vl_checkpoint(vl, tmp_path, capsys):
    """`qwenserve compare` takes chat prompts with image and video parts (file:// under the allowed path) and finds
    transformers' tokens and logits equal to the engine's."""
    import json

    from qwenserve.entrypoints.cli.main import main
    _, _, path = vl
    frame = tmp_path / "frame.png"
    FRAMES[0].save(frame)
    prompts = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "see "},
                                                   {"type": "image_url", "image_url": {"url": frame.as_uri()}}]}]},
        {"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": [data_url(f) for f in FRAMES]}}, {"type": "text", "text": "?"}]}]},
        "a text-only prompt",
    ]
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    code = main(["compare", "--model", path, "--prompts", str(prompts_file), "--max-tokens", "4", "--json",
                 "--allowed-local-media-path", str(tmp_path)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["all_equal"], report
    for result in report["prompts"]:
        assert result["hf_tokens"] == result["qwenserve_tokens"] and len(result["hf_tokens"]) >= 1
        assert result["max_logit_diff"] < 1e-4

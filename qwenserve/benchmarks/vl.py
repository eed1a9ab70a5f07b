"""`qwenserve bench vl`: images through a Qwen2-VL model, qwenserve against HF transformers on the same checkpoint.

No Qwen2-VL checkpoint can be downloaded where this runs, so the command writes one: transformers' own
Qwen2VLConfig and Qwen2VLForConditionalGeneration at the published Qwen2-VL-2B-Instruct sizes (or a tiny shape
for tests), random bf16 weights in safetensors, the published preprocessor settings, and the bundled model's
tokenizer (Qwen2.5's vocabulary, which holds Qwen2-VL's vision tokens at the same ids). Its text is noise; its cost
is the real model's.

Measured, on prompts of one image and `text_len` random ordinary tokens:
- TTFT: one request, from the PIL image to the first token (preprocessing, the tower, prefill), qwenserve's
  engine against HF's image processor plus `generate(max_new_tokens=1)`, alternating, a fresh image each round
  (qwenserve's prefix and encoder caches key on the image, so a repeated one would skip the work);
- the tower alone on the same image (qwenserve's `embed_images`, HF's `get_image_features`): its share of the
  TTFT, and its GFLOP/s from the tower's matrix products (`tower_flops`) against the best bf16 (run dtype) matmul
  this machine does in the way `bench kernels` times its dense path;
- throughput: `num_requests` requests with different images at once through qwenserve, against HF one request at
  a time (its sequential rate, measured over `hf_requests` of them), every request writing exactly `output_len`
  tokens.
Both sides run the same weights in the same dtype; the first greedy token of the TTFT prompt is reported for
each, and equal on a float32 run (tests/test_bench.py)."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.model_config import VisionConfig
from qwenserve.sample.sampling_params import SamplingParams

MARKER = "qwenserve_bench_vl.json"  # written last: a directory with it holds a complete checkpoint of its shape
WEIGHT_STD = 0.02  # a trained model's scale: activations stay finite through every layer
SHARD_BYTES = 1 << 30
# Qwen2-VL-2B-Instruct's preprocessor_config.json
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384


@dataclass(frozen=True)
class VLShape:
    label: str
    text: dict  # Qwen2VLTextConfig fields
    vision: dict  # Qwen2VLVisionConfig fields


# 2B: the published Qwen2-VL-2B-Instruct config.json (vocabulary, token ids and tied embeddings are set for all)
SHAPES = {
    "2B": VLShape("2B", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                             num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                              "mrope_section": [16, 24, 24]}),
                  dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=1536, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu")),
    "tiny": VLShape("tiny", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [2, 3, 3]}),
                    dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64, patch_size=14,
                         spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu")),
}


def bundled_tokenizer():
    """The bundled GGUF's tokenizer (Qwen2.5's: <|vision_start|> 151652 .. <|video_pad|> 151656, Qwen2-VL's ids)."""
    from qwenserve.model.loader.bundled import bundled_model_path
    from qwenserve.model.loader.gguf_file import GGUFFile
    from qwenserve.model.loader.tokenizer import tokenizer_from_gguf
    return tokenizer_from_gguf(GGUFFile(bundled_model_path()).metadata)


def hf_vl_config(shape: VLShape, tokenizer):
    from transformers import Qwen2VLConfig
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    eos, bos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = dict(shape.text, vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=True)
    return Qwen2VLConfig(text_config=text, vision_config=shape.vision, tie_word_embeddings=True, **ids)


def _random_weights(config, seed: int):
    """(name, tensor) for every tensor of the model, bf16: norm weights 1, the rest N(0, WEIGHT_STD); the tied LM
    head left out. One at a time: the 2B's 4.4 GB are never all in memory."""
    from transformers import Qwen2VLForConditionalGeneration
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(config)
    for i, (name, meta) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight":
            continue  # tied to the embedding
        if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
            yield name, torch.ones(meta.shape, dtype=torch.bfloat16)
        else:
            generator = torch.Generator().manual_seed(seed * 100_003 + i)
            yield name, (torch.randn(meta.shape, generator=generator) * WEIGHT_STD).to(torch.bfloat16)


def _save_sharded(tensors, directory: str) -> int:
    """Shards of about SHARD_BYTES and model.safetensors.index.json, as save_pretrained lays them out (safetensors
    copies a file's tensors into one buffer to write it, so a shard bounds that copy). Returns the bytes."""
    shards, current, size, total = [], {}, 0, 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(_write_shard(current, directory, len(shards)))
            current, size = {}, 0
        current[name], size, total = tensor, size + nbytes, total + nbytes
    shards.append(_write_shard(current, directory, len(shards)))
    weight_map = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(directory, f"shard-{i}.tmp"), os.path.join(directory, final))
        weight_map.update(dict.fromkeys(names, final))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total


def _write_shard(tensors: dict[str, torch.Tensor], directory: str, index: int) -> list[str]:
    from safetensors.torch import save_file
    save_file(tensors, os.path.join(directory, f"shard-{index}.tmp"), metadata={"format": "pt"})
    return list(tensors)


def write_vl_checkpoint(shape: VLShape, directory: str, seed: int = 0) -> dict:
    """The checkpoint of `shape` in `directory`: reused when a complete one of that shape and seed is there,
    written when the directory is absent or empty; anything else there is refused."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    mark = {"shape": shape.label, "seed": seed}
    marker = os.path.join(directory, MARKER)
    if os.path.isfile(marker):
        with open(marker) as f:
            found = json.load(f)
        if found != mark:
            raise ValueError(f"{directory} holds the bench vl checkpoint {found}, not {mark}; pass another "
                             f"--model-dir")
        return {"path": directory, "written": False}
    if os.path.isdir(directory) and os.listdir(directory):
        raise ValueError(f"{directory} is not empty and holds no bench vl checkpoint; pass a new or empty "
                         f"--model-dir")
    start = time.perf_counter()
    os.makedirs(directory, exist_ok=True)
    tokenizer = bundled_tokenizer()
    config = hf_vl_config(shape, tokenizer)
    config.dtype, config.architectures = "bfloat16", ["Qwen2VLForConditionalGeneration"]
    total = _save_sharded(_random_weights(config, seed), directory)
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(directory)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.text_config.bos_token_id,
                   "eos_token_id": [config.text_config.eos_token_id, config.text_config.bos_token_id]}, f)
    with open(marker, "w") as f:
        json.dump(mark, f)
    return {"path": directory, "written": True, "weight_bytes": total, "write_s": round(time.perf_counter() - start, 1)}


def tower_flops(vision: VisionConfig, grid: tuple[int, int, int]) -> int:
    """Multiply-adds x 2 of the Qwen2-VL tower on one image: the patch embedding, each block's qkv, attention
    (QK^T and AV within each frame), output projection and MLP, and the merger's two matrices. Norms, rotary
    and activations are left out (a few per cent)."""
    t, h, w = grid
    n, d, hidden = t * h * w, vision.hidden_size, vision.intermediate_size
    patch_in = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    block = 2 * n * d * 3 * d + 2 * n * d * d + 2 * 2 * n * d * hidden + t * 2 * 2 * (h * w) ** 2 * d
    merged_rows, merged = n // vision.merge_unit, d * vision.merge_unit
    merger = 2 * merged_rows * merged * (merged + vision.out_hidden_size)
    return 2 * n * patch_in * d + vision.depth * block + merger


def matmul_peak(dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> tuple[float, tuple[int, int, int]]:
    """The best GFLOP/s of an (M x K) @ (K x N) product over `shapes`, each timed as `bench kernels` times its
    dense path (oneDNN-packed weights where this torch packs bf16, F.linear otherwise)."""
    from qwenserve.benchmarks.kernels import timed
    from qwenserve.model.layers.linear import cpu_weight_packing_available
    best = (0.0, shapes[0])
    with torch.inference_mode():
        for m, k, n in shapes:
            x, weight = torch.randn(m, k).to(dtype), (torch.randn(n, k) * WEIGHT_STD).to(dtype)
            if cpu_weight_packing_available(weight):
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, m)
                fn = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
            else:
                fn = lambda: F.linear(x, weight)  # noqa: E731
            seconds = min(timed(fn, min_seconds=0.5) for _ in range(2))
            best = max(best, (2 * m * k * n / seconds / 1e9, (m, k, n)))
    return best


def random_image(size: int, seed: int):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


class HFSide:
    """HF transformers on the checkpoint: its image processor (from preprocessor_config.json), the placeholder
    expanded as its processor does, its generate."""

    def __init__(self, path: str, dtype: torch.dtype):
        from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
        self.processor = AutoImageProcessor.from_pretrained(path)
        self.pad = self.model.config.image_token_id
        eos = self.model.generation_config.eos_token_id
        self.pad_token_id = eos[0] if isinstance(eos, list) else eos  # no padding in a batch of one

    def inputs(self, ids: list[int], image) -> dict:
        processed = self.processor(images=[image], return_tensors="pt")
        grid = processed["image_grid_thw"]
        at = ids.index(self.pad)
        ids = ids[:at] + [self.pad] * (int(grid[0].prod()) // self.processor.merge_size ** 2) + ids[at + 1:]
        input_ids = torch.tensor([ids])
        return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                    pixel_values=processed["pixel_values"].to(self.model.dtype), image_grid_thw=grid,
                    mm_token_type_ids=(input_ids == self.pad).int())

    @torch.inference_mode()
    def generate(self, ids: list[int], image, new_tokens: int) -> list[int]:
        inputs = self.inputs(ids, image)
        out = self.model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=self.pad_token_id)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    @torch.inference_mode()
    def tower(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        features = self.model.model.get_image_features(pixels.to(self.model.dtype), torch.tensor([grid]))
        return getattr(features, "pooler_output", features)


class QwenserveSide:
    def __init__(self, config: EngineConfig):
        from qwenserve.engine.llm_engine import LLMEngine
        self.engine = LLMEngine(config)
        worker = getattr(self.engine.executor, "worker", None)
        if worker is None:
            raise ValueError("bench vl times the tower in this process: run it without tensor, pipeline or data "
                             "parallelism")
        self.model = worker.model_runner.model
        self.processor = self.engine.input_processor.image_processor
        self.count = 0

    def run(self, requests: list[tuple[list[int], object]], new_tokens: int) -> tuple[float, list[list[int]]]:
        """All requests at once: (seconds until the last finishes, each one's tokens)."""
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        start, tags = time.perf_counter(), []
        for ids, image in requests:
            self.count += 1
            tags.append(f"vl-{self.count}")
            self.engine.add_request(tags[-1], {"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}},
                                    params)
        tokens = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
        return time.perf_counter() - start, [tokens[tag] for tag in tags]

    @torch.inference_mode()
    def tower(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        return self.model.embed_images(pixels, [grid])


def _timed(fn) -> tuple[float, object]:
    """(seconds, fn's result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def bench_vl(settings: dict, shape: VLShape, model_dir: str | None, image_size: int, text_len: int,
             num_requests: int, output_len: int, hf_requests: int, rounds: int) -> dict:
    """settings: the engine's (EngineConfig.from_user_settings' arguments) but the model, which is the written
    checkpoint in model_dir (a temporary directory, removed after, if None)."""
    temp = None
    if model_dir is None:
        temp = model_dir = tempfile.mkdtemp(prefix="qwenserve-bench-vl-")
    try:
        checkpoint = write_vl_checkpoint(shape, model_dir)
        config = EngineConfig.from_user_settings(**settings, model=model_dir)
        return _measure(config, checkpoint, image_size, text_len, num_requests, output_len, hf_requests, rounds)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _measure(config: EngineConfig, checkpoint: dict, image_size: int, text_len: int, num_requests: int,
             output_len: int, hf_requests: int, rounds: int) -> dict:
    from qwenserve.benchmarks.common import ordinary_vocab, peak_rss_gb, random_prompts
    ours = QwenserveSide(config)
    dtype = ours.engine.resolved_model.dtype
    hf = HFSide(checkpoint["path"], dtype)
    vision = ours.model.vision
    tokenizer = ours.engine.tokenizer
    image_prompt = [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]
    texts = iter(random_prompts(1 + rounds + num_requests + hf_requests, text_len, ordinary_vocab(tokenizer),
                                seed=11))
    seeds = iter(range(1_000_000))

    def request() -> tuple[list[int], object]:
        """A fresh prompt and image: nothing of it is in qwenserve's prefix or encoder cache."""
        return image_prompt + next(texts), random_image(image_size, next(seeds))

    def alternating(sides: dict, make_args) -> tuple[dict[str, list[float]], dict]:
        """Seconds of each side's runs, `rounds` of them alternating which goes first (new arguments from
        make_args each round), and each side's last result."""
        times, results = {name: [] for name in sides}, {}
        for r in range(rounds):
            args = make_args()
            for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                seconds, results[name] = _timed(lambda: sides[name](*args))
                times[name].append(seconds)
        return times, results

    # warm-up of both (one-off costs), then the TTFT rounds, a new image each
    warm = request()
    ours.run([warm], 2)
    hf.generate(*warm, 2)
    ttft, first_tokens = alternating({"qwenserve": lambda ids, image: ours.run([(ids, image)], 1)[1][0][0],
                                      "hf": lambda ids, image: hf.generate(ids, image, 1)[0]}, request)

    # the tower alone, both on the same pixel values (qwenserve's processor's, equal to HF's to the bit)
    processed = ours.processor.process(random_image(image_size, next(seeds)))
    pixels, grid = torch.from_numpy(processed.pixel_values), processed.grid
    ours.tower(pixels, grid)
    hf.tower(pixels, grid)
    tower, _ = alternating({"qwenserve": ours.tower, "hf": hf.tower}, lambda: (pixels, grid))
    flops = tower_flops(vision, grid)
    # the peak: the tower's fc1 and merger products at its row counts, and a large square one
    patches, merged = grid[1] * grid[2], vision.hidden_size * vision.merge_unit
    peak, peak_shape = matmul_peak(dtype, [(patches, vision.hidden_size, vision.intermediate_size),
                                           (patches // vision.merge_unit, merged, merged), (2048, 4096, 4096)])

    # throughput: all requests at once against HF one at a time
    ours_s, _ = ours.run([request() for _ in range(num_requests)], output_len)
    hf_s = sum(_timed(lambda: hf.generate(*request(), output_len))[0] for _ in range(hf_requests))

    ttft_ms = {k: statistics.median(v) * 1e3 for k, v in ttft.items()}
    tower_ms = {k: statistics.median(v) * 1e3 for k, v in tower.items()}
    ours_rate, hf_rate = num_requests / ours_s, hf_requests / hf_s
    return {
        "checkpoint": checkpoint["path"], "checkpoint_written": checkpoint["written"],
        "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "image": f"{image_size}x{image_size}", "image_tokens": processed.num_tokens, "text_len": text_len,
        "rounds": rounds,
        "ttft_ms": round(ttft_ms["qwenserve"], 1), "hf_ttft_ms": round(ttft_ms["hf"], 1),
        "ttft_runs_ms": [round(t * 1e3, 1) for t in ttft["qwenserve"]],
        "hf_ttft_runs_ms": [round(t * 1e3, 1) for t in ttft["hf"]],
        "tower_ms": round(tower_ms["qwenserve"], 1), "hf_tower_ms": round(tower_ms["hf"], 1),
        "tower_share_of_ttft": round(tower_ms["qwenserve"] / ttft_ms["qwenserve"], 3),
        "hf_tower_share_of_ttft": round(tower_ms["hf"] / ttft_ms["hf"], 3),
        "tower_gflop": float(f"{flops / 1e9:.4g}"),
        "tower_GFLOPs": round(flops / tower_ms["qwenserve"] / 1e6, 1),
        "hf_tower_GFLOPs": round(flops / tower_ms["hf"] / 1e6, 1),
        "matmul_peak_GFLOPs": round(peak, 1), "matmul_peak_shape": "x".join(map(str, peak_shape)),
        "tower_share_of_peak": round(flops / tower_ms["qwenserve"] / 1e6 / peak, 3),
        "first_token": first_tokens["qwenserve"], "hf_first_token": first_tokens["hf"],
        "requests": num_requests, "output_len": output_len, "hf_requests": hf_requests,
        "requests_per_s": round(ours_rate, 3), "hf_sequential_requests_per_s": round(hf_rate, 3),
        "output_tokens_per_s": round(ours_rate * output_len, 2),
        "hf_sequential_output_tokens_per_s": round(hf_rate * output_len, 2),
        "throughput_over_hf_sequential": round(ours_rate / hf_rate, 2),
        "peak_rss_gb": peak_rss_gb(),
    }

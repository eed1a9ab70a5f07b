"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints made with transformers' own classes (config, model, image
processor), and the reference's greedy tokens for prompts with images."""
from __future__ import annotations

import base64
import copy
import io
import json
import os

import numpy as np
import torch

from helpers import SPECIAL_TOKENS, tiny_tokenizer, tiny_vocab

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VL_SPECIALS = SPECIAL_TOKENS + VISION_TOKENS
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 48  # images of 4 to 48 tokens
ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def vl_token_ids() -> dict[str, int]:
    tokens = tiny_vocab(320, VL_SPECIALS)[0]
    return {"image_token_id": tokens.index("<|image_pad|>"), "video_token_id": tokens.index("<|video_pad|>"),
            "vision_start_token_id": tokens.index("<|vision_start|>"),
            "vision_end_token_id": tokens.index("<|vision_end|>"),
            "eos_token_id": tokens.index("<|im_end|>"), "bos_token_id": tokens.index("<|endoftext|>")}


def tiny_hf_vl_model(kind: str = "qwen2_vl", seed: int = 0, vision: dict | None = None):
    """A random Qwen2-VL (or Qwen2.5-VL: windows of 2x2 merged tokens, blocks 1 and 3 over the whole image), float32,
    with non-trivial norms and biases. vision: vision_config fields that replace these defaults."""
    import transformers
    ids = vl_token_ids()
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                eos_token_id=ids["eos_token_id"], bos_token_id=ids["bos_token_id"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    tokens = {k: v for k, v in ids.items() if k not in ("eos_token_id", "bos_token_id")}
    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2) | (vision or {})
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        cls = transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56,
                      fullatt_block_indexes=[1, 3]) | (vision or {})
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.generation_config.eos_token_id = ids["eos_token_id"]
    model.generation_config.pad_token_id = ids["eos_token_id"]
    return model


def hf_image_processor(**settings):
    """transformers' PIL image processor; settings (max_pixels, patch_size, merge_size, ...) replace the defaults."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(**{"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS} | settings)


# a video processor's settings as transformers saves its defaults (video_preprocessor_config.json)
VIDEO_SETTINGS = {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}}


def save_hf_vl_dir(model, path: str, processor=None, video_settings: dict | None = VIDEO_SETTINGS) -> str:
    """The checkpoint, the tiny tokenizer, the image processor (hf_image_processor() unless given) and the video
    processor's settings (None: no video_preprocessor_config.json, so videos take the image processor's)."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(320, VL_SPECIALS).save_pretrained(path)
    (processor or hf_image_processor()).save_pretrained(path)
    if video_settings is not None:
        with open(os.path.join(path, "video_preprocessor_config.json"), "w") as f:
            json.dump(video_settings, f)
    ids = vl_token_ids()
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": ids["eos_token_id"], "bos_token_id": ids["bos_token_id"]}, f)
    return path


def random_image(height: int, width: int, seed: int = 0):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def hf_greedy(hf, tokenizer, text: str, images: list, max_new_tokens: int, processor=None) -> list[int]:
    """transformers' own pipeline: its image processor (hf_image_processor() unless given), placeholders expanded as
    its processor does, its generate: max_new_tokens argmax tokens, an end-of-sequence one taken like any other (as
    ignore_eos runs; min_new_tokens would mask it instead)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    kwargs = {}
    if images:
        processed = (processor or hf_image_processor())(images=images, return_tensors="pt")
        pad, grids = hf.config.image_token_id, processed["image_grid_thw"]
        merge_unit = hf.config.vision_config.spatial_merge_size ** 2
        expanded, k = [], 0
        for t in ids:
            if t == pad:
                expanded += [pad] * int(grids[k].prod() // merge_unit)
                k += 1
            else:
                expanded.append(t)
        ids = expanded
        kwargs = dict(pixel_values=processed["pixel_values"], image_grid_thw=grids,
                      mm_token_type_ids=(torch.tensor([ids]) == pad).int())
    input_ids = torch.tensor([ids])
    config = copy.deepcopy(hf.generation_config)
    config.update(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[])
    with torch.no_grad():
        out = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                          **kwargs)
    return out[0, len(ids):].tolist()

"""Qwen2-VL's prompt side of images, as Qwen's processor does it (transformers' Qwen2VLImageProcessor, PIL path):
- an image (PIL, or a data: URL) is converted to RGB (transparency onto white), resized with bicubic filtering to
  sides that are multiples of 28 (patch 14 x merge 2) and hold between min_pixels and max_pixels pixels, keeping
  the aspect ratio as closely as that allows (`smart_resize`), scaled to [0, 1] and normalised with CLIP's mean
  and std;
- cut into 14x14 patches, each repeated over 2 frames (temporal_patch_size: a still image is a two-frame clip),
  ordered 2x2 block by 2x2 block so the tower's merger finds each block's patches next to each other: pixel values
  [patches, 3 * 2 * 14 * 14] and the grid (1, rows, columns) in patches;
- in the prompt, each image is one <|image_pad|> (between <|vision_start|> and <|vision_end|>, as the chat template
  writes it) expanded to rows * columns / 4 placeholder tokens, which the tower's output replaces.
A video (its frames) goes the same way, as transformers' Qwen2VLVideoProcessor does it: each pair of frames is one
temporal patch, the grid (frames / 2, rows, columns), its placeholder <|video_pad|>. Its frames' pixel limits come
from video_preprocessor_config.json, or, where a checkpoint has none, from preprocessor_config.json (as
transformers falls back to it), else the video processor's defaults; its frame rate (Qwen2.5-VL's temporal
positions follow it) from the request, else 2 per second.
Bad input (undecodable data, a remote URL offline, too many images, placeholders that do not match the images) is a
RequestError naming the problem."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np

from qwenserve.config.errors import RequestError
from qwenserve.config.model_config import VisionConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280  # transformers' default; published checkpoints set their own
MAX_ASPECT_RATIO = 200
# a video's frames where the checkpoint sets no limits: transformers' Qwen2VLVideoProcessor defaults (128 to 768
# tokens a frame pair)
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
# frames given as a list carry no time: they are taken as sampled at 2 per second (qwen-vl-utils' default), which
# Qwen2.5-VL's temporal positions depend on
VIDEO_FPS = 2.0
MAX_VIDEO_FRAMES = 768


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of factor, scaled into [min_pixels, max_pixels] if the rounding leaves
    them outside (Qwen's rule, to the pixel)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise RequestError(f"an image's aspect ratio must be below {MAX_ASPECT_RATIO}, got {width}x{height}",
                           param="image")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # float32 [patches, channels * temporal_patch * patch * patch]
    grid: tuple[int, int, int]  # (t, rows, columns) in patches, as image_grid_thw
    num_tokens: int  # placeholder tokens in the prompt: patches / merge_size ** 2
    content_hash: bytes  # sha256 of the pixel values and grid: what the prefix cache and encoder cache key on
    time_interval: float = 1.0  # M-RoPE temporal positions between frames (core/multimodal.py's ImageInput)


def pixel_limits(config: dict, default_min: int, default_max: int) -> tuple[int, int]:
    """(min_pixels, max_pixels) as a Qwen2-VL processor config gives them: its own min_pixels / max_pixels, else
    its size's shortest_edge / longest_edge (or size's min_pixels / max_pixels, older files), else the defaults."""
    size = config.get("size") or {}
    return (config.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or default_min,
            config.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or default_max)


class Qwen2VLProcessor:
    def __init__(self, vision: VisionConfig, preprocessor_config: dict, video_preprocessor_config: dict | None = None):
        """preprocessor_config: the checkpoint's preprocessor_config.json ({} for Qwen's defaults);
        video_preprocessor_config: its video_preprocessor_config.json (None: absent)."""
        cfg = preprocessor_config
        self.vision = vision
        self.min_pixels, self.max_pixels = pixel_limits(cfg, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
        video = video_preprocessor_config if video_preprocessor_config is not None else cfg
        self.video_min_pixels, self.video_max_pixels = pixel_limits(video, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
        self.mean = np.asarray(cfg.get("image_mean", CLIP_MEAN), dtype=np.float32)
        self.std = np.asarray(cfg.get("image_std", CLIP_STD), dtype=np.float32)
        self.rescale = cfg.get("rescale_factor", 1 / 255)
        for name, ours in (("patch_size", vision.patch_size), ("merge_size", vision.spatial_merge_size),
                           ("temporal_patch_size", vision.temporal_patch_size)):
            if cfg.get(name, ours) != ours:
                raise ValueError(f"preprocessor_config.json's {name} ({cfg[name]}) differs from the vision "
                                 f"config's ({ours})")

    def process(self, image) -> ProcessedImage:
        """A PIL image, a data: URL or image bytes -> its pixel values, grid and placeholder count."""
        v = self.vision
        factor = v.patch_size * v.spatial_merge_size
        pil = to_rgb(load_image(image))
        height, width = smart_resize(pil.height, pil.width, factor, self.min_pixels, self.max_pixels)
        from PIL import Image
        pil = pil.resize((width, height), resample=Image.Resampling.BICUBIC)
        # as transformers: scaled in float64, stored in float32, normalised in float32
        pixels = (np.asarray(pil).astype(np.float64) * self.rescale).astype(np.float32)
        pixels = ((pixels - self.mean) / self.std).transpose(2, 0, 1)  # [channels, height, width]
        patches, grid = _patchify(pixels, v.patch_size, v.spatial_merge_size, v.temporal_patch_size)
        digest = hashlib.sha256(np.asarray(grid, dtype=np.int64).tobytes() + patches.tobytes()).digest()
        return ProcessedImage(patches, grid, patches.shape[0] // v.merge_unit, digest)

    def process_video(self, frames) -> ProcessedImage:
        """A video as its frames (PIL images, data: URLs or bytes, all of one size; or a uint8 array [frames,
        height, width, 3]), or (frames, metadata) with the rate they were sampled at as metadata["fps"] (vLLM's
        form; else VIDEO_FPS) -> its pixel values, grid (t, rows, columns) and placeholder count, as transformers'
        Qwen2VLVideoProcessor makes them: the frames resized together (bicubic with antialiasing, in torch, as it
        does), the last repeated up to a multiple of the temporal patch, each pair of frames one temporal patch."""
        import torch
        import torch.nn.functional as F
        v = self.vision
        frames, fps = video_frames_and_fps(frames)
        if isinstance(frames, np.ndarray):
            if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
                raise RequestError(f"a video array must be uint8 [frames, height, width, 3], got {frames.dtype} "
                                   f"{list(frames.shape)}", param="video")
            array = frames
        else:
            if not isinstance(frames, (list, tuple)) or not frames:
                raise RequestError("a video must be a non-empty list of frames", param="video")
            pils = [to_rgb(load_image(frame)) for frame in frames]
            sizes = {pil.size for pil in pils}
            if len(sizes) > 1:
                raise RequestError(f"a video's frames must all have one size, got {sorted(sizes)}", param="video")
            array = np.stack([np.asarray(pil) for pil in pils])
        if len(array) > MAX_VIDEO_FRAMES:
            raise RequestError(f"a video may have at most {MAX_VIDEO_FRAMES} frames, got {len(array)}",
                               param="video")
        factor = v.patch_size * v.spatial_merge_size
        height, width = smart_resize(array.shape[1], array.shape[2], factor, self.video_min_pixels,
                                     self.video_max_pixels)
        video = torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2).float()  # [frames, c, h, w]
        video = F.interpolate(video, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
        video = video.clamp_(0, 255).round_()  # back to uint8 values, as torchvision does
        # as transformers' torch path: rescale and normalisation fused into one float32 step
        mean = torch.tensor([m / self.rescale for m in self.mean.tolist()], dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor([d / self.rescale for d in self.std.tolist()], dtype=torch.float32).view(1, 3, 1, 1)
        video = ((video - mean) / std).numpy()
        if pad := -len(video) % v.temporal_patch_size:
            video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
        patches, grid = _patchify_video(video, v.patch_size, v.spatial_merge_size, v.temporal_patch_size)
        interval = 1.0 if v.tokens_per_second is None else v.tokens_per_second * v.temporal_patch_size / fps
        # the positions after the video follow its interval: two rates must not share cached KV
        digest = hashlib.sha256(b"video" + np.asarray([interval]).tobytes() + np.asarray(grid, dtype=np.int64).tobytes()
                                + patches.tobytes()).digest()
        return ProcessedImage(patches, grid, patches.shape[0] // v.merge_unit, digest, interval)

    def expand_placeholders(self, ids: list[int], images: list[ProcessedImage],
                            videos: list[ProcessedImage] = ()) -> tuple[list[int], list[int], list[int]]:
        """The prompt with each image's <|image_pad|> and each video's <|video_pad|> expanded to its placeholder
        count (a run already of that length is kept), and where each image's and each video's placeholders
        start. One pass over both, so each keeps its place whatever the other's expansion adds before it."""
        v = self.vision
        items = {v.image_token_id: ("image", list(images)), v.video_token_id: ("video", list(videos))}
        runs = sorted((start, length, pad) for pad in items for start, length in token_runs(ids, pad))
        for pad, (kind, given) in items.items():
            found = sum(1 for run in runs if run[2] == pad)
            if found != len(given):
                raise RequestError(f"the prompt has {found} {kind} placeholders (<|{kind}_pad|>) for {len(given)} "
                                   f"{kind}s", param="multi_modal_data")
        out, index, offsets = [], 0, {pad: [] for pad in items}
        for start, length, pad in runs:
            kind, given = items[pad]
            item = given[len(offsets[pad])]
            if length not in (1, item.num_tokens):
                raise RequestError(f"{kind} {len(offsets[pad]) + 1}'s placeholder run has {length} tokens; it needs "
                                   f"1 or {item.num_tokens} (its size in tokens)", param="multi_modal_data")
            out += ids[index:start]
            offsets[pad].append(len(out))
            out += [pad] * item.num_tokens
            index = start + length
        return out + ids[index:], offsets[v.image_token_id], offsets[v.video_token_id]


def video_frames_and_fps(video) -> tuple[object, float]:
    """(frames, frame rate) of a video given as its frames or as (frames, metadata) with metadata["fps"]."""
    if not (isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict)):
        return video, VIDEO_FPS
    frames, metadata = video
    fps = metadata.get("fps", VIDEO_FPS)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf"):
        raise RequestError(f"a video's fps must be a positive number, got {fps!r}", param="video")
    return frames, float(fps)


def token_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of token in ids."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _patchify(pixels: np.ndarray, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[channels, height, width] -> ([patches, channels * temporal * patch * patch], (1, rows, columns)): 2x2 blocks
    in row-major order, row-major patches within a block, each patch channel-major and repeated over the frames."""
    c, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    blocks = pixels.reshape(c, rows // merge, merge, patch, cols // merge, merge, patch)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # block row, block col, row in block, col in block, c, y, x
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], temporal, patch, patch))
    return np.ascontiguousarray(frames.reshape(rows * cols, c * temporal * patch * patch)), (1, rows, cols)


def _patchify_video(video: np.ndarray, patch: int, merge: int, temporal: int
                    ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[frames, channels, height, width] (frames a multiple of temporal) -> ([patches, channels * temporal * patch
    * patch], (t, rows, columns)): as _patchify, with consecutive frames filling each patch's temporal slots."""
    frames, c, height, width = video.shape
    t, rows, cols = frames // temporal, height // patch, width // patch
    blocks = video.reshape(t, temporal, c, rows // merge, merge, patch, cols // merge, merge, patch)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, block row, block col, row, col, c, frame, y, x
    return (np.ascontiguousarray(blocks).reshape(t * rows * cols, c * temporal * patch * patch),
            (t, rows, cols))


def load_image(source):
    """A PIL image as given, or decoded from a data: URL or raw bytes; anything else is a RequestError."""
    from PIL import Image, UnidentifiedImageError
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, str):
        if source.startswith(("http://", "https://")):
            raise RequestError("image URLs are not fetched here: pass a data: URL or a PIL image", param="image_url")
        if not source.startswith("data:"):
            raise RequestError(f"an image must be a data: URL or a PIL image, got a string starting "
                               f"{source[:30]!r}", param="image_url")
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise RequestError("an image data: URL must be base64 (data:image/png;base64,...)", param="image_url")
        try:
            source = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("an image data: URL holds invalid base64", param="image_url") from None
    if isinstance(source, (bytes, bytearray)):
        try:
            image = Image.open(io.BytesIO(source))
            image.load()
            return image
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise RequestError(f"an image could not be decoded: {e}", param="image") from None
    raise RequestError(f"an image must be a PIL image or a data: URL, got {type(source).__name__}", param="image")


def to_rgb(image):
    """RGB, with any transparency composited onto white (as transformers does)."""
    from PIL import Image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")
    return image.convert("RGB")

"""Chat messages whose content is a list of OpenAI parts, split into what the chat template renders and the media
the engine takes: each image part becomes the model's image placeholder in the text (Qwen2-VL's
<|vision_start|><|image_pad|><|vision_end|>, which is what its chat template writes for one), each video part its
video placeholder, and the parts' sources are kept in order, each with the part's name (messages[0].content[1]) so
an error about it can say which one.

Part types: text; image_url ({"url": data:, http(s):// or file:// URL}), and offline image_pil / image (a PIL
image); video_url ({"url": [frame URLs], "fps": the rate they were sampled at, optional}: a video as its frames,
since no video decoder is here), and offline video (a list of frames)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qwenserve.config.errors import RequestError
from qwenserve.entrypoints.media import MediaConnector

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")
VIDEO_PART_TYPES = ("video_url", "video")
PART_TYPES = ("text",) + IMAGE_PART_TYPES + VIDEO_PART_TYPES


@dataclass(frozen=True)
class MediaPart:
    where: str  # the content part, as an error names it: messages[0].content[1]
    modality: str  # "image" or "video"
    source: Any  # image: a URL, PIL image or bytes; video: a list of them, its frames in order
    fps: Any = None  # a video's frame rate, where the part gives one


def split_content(messages: list[dict], placeholders: dict[str, str] | None,
                  limits: dict[str, int] | None = None) -> tuple[list[dict], list[MediaPart]]:
    """(messages with string content, their media parts in order). placeholders: the text that stands for one
    item of each modality the model takes (None: a text-only model, and any media part is refused); limits: the
    most items of each modality one prompt may hold (limit_mm_per_prompt)."""
    placeholders, limits = placeholders or {}, limits or {}
    out, media = [], []
    counts = dict.fromkeys(("image", "video"), 0)
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        text = []
        for p, part in enumerate(content):
            where = f"messages[{m}].content[{p}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise RequestError(f"{where}: a text part needs its text as a string", param=where)
                text.append(part["text"])
                continue
            if kind not in PART_TYPES:
                raise RequestError(f"{where} has type {kind!r}; supported: {', '.join(PART_TYPES)}", param=where)
            modality = "image" if kind in IMAGE_PART_TYPES else "video"
            source, fps = _source(part, kind, where)
            if not placeholders:
                raise RequestError(f"{where} is {'an image' if modality == 'image' else 'a video'}, but this model "
                                   f"is text-only", param=where)
            counts[modality] += 1
            limit = limits.get(modality)
            if limit is not None and counts[modality] > limit:
                raise RequestError(f"{where}: one prompt may hold at most {limit} {modality}s "
                                   f"(--limit-mm-per-prompt)", param=where)
            media.append(MediaPart(where, modality, source, fps))
            text.append(placeholders[modality])
        out.append({**message, "content": "".join(text)})
    return out, media


def _source(part: dict, kind: str, where: str) -> tuple[Any, float | None]:
    """(the part's image or frames, a video part's fps or None; the video processor checks it)."""
    source, fps = part.get(kind), None
    if kind.endswith("_url") and isinstance(source, dict):
        source, fps = source.get("url"), source.get("fps") if kind in VIDEO_PART_TYPES else None
    if source is None or (isinstance(source, (list, tuple, str)) and not source):
        raise RequestError(f"{where} ({kind}) holds no {'image' if kind in IMAGE_PART_TYPES else 'video'}",
                           param=where)
    if kind in VIDEO_PART_TYPES and not isinstance(source, (list, tuple)):
        raise RequestError(f"{where}: a video is taken as its frames, a list of image URLs ({kind}.url: "
                           f"[\"data:image/png;base64,...\", ...]); video files are not decoded here (no video "
                           f"decoder)", param=where)
    return source, fps


def load_media(parts: list[MediaPart], connector: MediaConnector) -> dict[str, list]:
    """The parts' media, decoded: {"image": [PIL images], "video": [[PIL frames], ...]}, only the modalities
    present. Blocking (remote URLs are fetched): the server calls it in a thread."""
    out: dict[str, list] = {}
    for part in parts:
        if part.modality == "image":
            item = connector.load_image(part.source, part.where)
        else:
            item = []
            for i, frame in enumerate(part.source):
                try:
                    item.append(connector.load_image(frame, part.where))
                except RequestError as e:  # which frame, in the part's message; the part stays the param
                    raise RequestError(str(e).replace(part.where, f"{part.where} (frame {i})", 1),
                                       param=part.where) from None
        out.setdefault(part.modality, []).append(item if part.fps is None else (item, {"fps": part.fps}))
    return out


def media_placeholders(tokenizer, vision) -> dict[str, str] | None:
    """The text of one image and of one video in this tokenizer's spelling: the vision markers around one pad
    token; None for a text-only model (vision None)."""
    if vision is None:
        return None

    def marked(pad: int) -> str:
        return "".join(tokenizer.convert_ids_to_tokens([vision.vision_start_token_id, pad,
                                                         vision.vision_end_token_id]))
    return {"image": marked(vision.image_token_id), "video": marked(vision.video_token_id)}

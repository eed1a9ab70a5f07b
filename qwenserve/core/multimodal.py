"""An image in a prompt (or a video: an image whose grid has several frame pairs), as the scheduler and the worker
see it: where its placeholder tokens sit, what its content hashes to, and its preprocessed pixels.

The pixels (a float32 numpy array) travel to the worker inside the new sequence's data (core/step.py), once per
sequence: the worker runs the vision tower, so it needs them, and a side channel for a few megabytes per image
would be more machinery than this one copy. The scheduler reads only the offsets and the hash (prefix-cache keys)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class ImageInput:
    offset: int  # index of the image's first placeholder token in the prompt
    num_tokens: int  # placeholder tokens (the tower's output rows)
    grid: tuple[int, int, int]  # (t, rows, columns) in patches, as image_grid_thw
    content_hash: bytes  # sha256 of the preprocessed pixels: equal images share KV blocks and encoder outputs
    pixel_values: Any  # numpy float32 [patches, channels * temporal_patch * patch * patch]
    # M-RoPE temporal positions between the grid's frames: 1 for an image and a Qwen2-VL video, tokens_per_second *
    # seconds per temporal patch for a Qwen2.5-VL video
    time_interval: float = 1.0

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its placeholders lies in token positions [start, end)."""
        return self.offset < end and start < self.end

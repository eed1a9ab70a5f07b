"""Vision-tower outputs kept between steps, keyed by image content: a prompt whose prefill is chunked across steps
runs the tower for each image once, and so do requests (and the n samples of one) that carry the same image.
Bounded in bytes; the least recently used output leaves first, and one larger than the whole budget is used and not
kept. An output that left is computed again if a later chunk needs it (the cost is time, never a wrong result)."""
from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._outputs: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.computed = 0  # outputs put here, each one image run through the tower (tests and statistics)

    def get(self, key: bytes) -> torch.Tensor | None:
        out = self._outputs.get(key)
        if out is not None:
            self._outputs.move_to_end(key)
        return out

    def put(self, key: bytes, output: torch.Tensor) -> None:
        """Keep an output the tower just computed (counted whether or not it fits)."""
        self.computed += 1
        size = output.numel() * output.element_size()
        if size > self.max_bytes or key in self._outputs:
            return
        while self.bytes + size > self.max_bytes:
            _, evicted = self._outputs.popitem(last=False)
            self.bytes -= evicted.numel() * evicted.element_size()
        self._outputs[key] = output
        self.bytes += size

"""Incremental detokenization: the text each new token adds, never a broken UTF-8 character.

A byte-level BPE token can hold part of a multi-byte character; its decoded text then ends in U+FFFD.
The decoder keeps a short window of recent tokens and emits text only once it decodes cleanly."""
from __future__ import annotations

PROMPT_CONTEXT = 5  # trailing prompt tokens used as context, so the first output token decodes as in the full text


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust decoder directly: several times faster than the Python wrapper
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


class StopStringMatcher:
    """Finds the first stop string in growing text; `safe_len` is how much text cannot turn into the start
    of a stop string later, i.e. may be streamed."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string ending in text[new_from:], if any."""
        begin = max(0, new_from - self.hold)
        best = None
        for s in self.stops:
            i = text.find(s, begin)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def safe_len(self, text: str) -> int:
        return len(text) - self.hold if self.stops else len(text)

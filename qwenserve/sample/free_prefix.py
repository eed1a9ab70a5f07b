"""Where a sequence stands with its constraint's free prefix (structured_outputs.FreePrefix): free text that the
grammar waits out, a thinking model's reasoning, which the engine knows only as "free until this marker".

A gate follows one sequence's tokens, as bytes, through these phases:

- undecided (the prefix has a `start`): the output so far is blank or a cut `start`. Both ways stay open: the
  grammar takes the tokens it allows, and the tokens that begin or continue `start` are allowed too
  (opening_masks). A token that is only blanks is the grammar's alone: blanks open nothing, and an output
  allowed them while the grammar refuses them could write blanks until max_tokens, never starting either way.
  Decided as the reasoning parsers decide: output whose first non-blank text is `start` opens the free text;
  any other is the constrained answer, which the grammar has then taken from its first token.
- free: nothing is masked; the constraint starts right after `end`, which is found in the bytes whatever the
  tokens it is cut into. Bytes after `end` in the same token are the answer's first (the grammar takes them),
  blanks at their start aside: the free text's tokens are unmasked, so its last may carry a newline after
  `end` that a grammar with no free whitespace would refuse.
- leading blanks (answer_blanks: a JSON answer or a tool call): where the answer starts at a token boundary, up
  to MAX_LEADING_BLANK_TOKENS tokens that are only blanks are allowed beside the grammar's and not fed to it.
  Qwen3 writes `</think>` and then `\n\n`, two tokens, before its answer; a grammar with no free whitespace
  would mask that blank and push the model off the text it writes. The first token with other text is the
  grammar's, and so is everything after the limit.
- constrained: the grammar alone, as for a constraint without a free prefix.

Undecided text is decoded as the detokenizer decodes it (a cut UTF-8 character waits for its end), and a special
token the detokenizer leaves out is no text here either (the manager feeds GrammarCompiler.text_bytes), so a gate
decides where the server's reasoning splitter does. No llguidance here: the engine's manager drives the matcher."""
from __future__ import annotations

import codecs
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from qwenserve.sample.structured_outputs import BLANKS, FreePrefix

UNDECIDED, FREE, LEADING_BLANKS, CONSTRAINED = "undecided", "free", "leading blanks", "constrained"
# blank-only tokens an answer after its free text may start with: Qwen3's `\n\n` is one, and a bound keeps an
# output that the grammar would refuse blanks from writing them until max_tokens
MAX_LEADING_BLANK_TOKENS = 2


def route(lead: str, start: str) -> str:
    """The phase output whose text so far, BLANKS stripped at its start, is `lead` is in: FREE once it opens with
    start, UNDECIDED while it may still (blank, or a cut start), CONSTRAINED otherwise."""
    if lead.startswith(start):
        return FREE
    return UNDECIDED if start.startswith(lead) else CONSTRAINED


def opening_masks(token_texts: Iterable[tuple[int, str]], start: str, words: int) -> dict[str, np.ndarray]:
    """For each undecided lead ("" and every proper prefix of start), the bitmask row (int32 words, the grammar's
    layout) of the tokens that begin or continue start (after blanks, at the output's start): after one, the
    output has opened or may still open with start. token_texts: each token's text decoded alone; empty ones
    (tokens with no text) and blank ones (which leave the lead as it was) are never allowed."""
    rows = {start[:i]: np.zeros(words, dtype=np.uint32) for i in range(len(start))}
    for token_id, text in token_texts:
        stripped = text.lstrip(BLANKS)
        if not stripped or stripped[0] not in start:
            continue  # cannot begin or continue start: the common case, decided without the leads
        for lead, row in rows.items():
            if route((lead + text).lstrip(BLANKS), start) != CONSTRAINED:
                row[token_id >> 5] |= np.uint32(1 << (token_id & 31))
    return {lead: row.view(np.int32) for lead, row in rows.items()}


def blank_tokens_mask(token_texts: Iterable[tuple[int, str]], words: int) -> np.ndarray:
    """The bitmask row (int32 words) of the tokens whose text, decoded alone, is only BLANKS (and not empty)."""
    row = np.zeros(words, dtype=np.uint32)
    for token_id, text in token_texts:
        if text and not text.strip(BLANKS):
            row[token_id >> 5] |= np.uint32(1 << (token_id & 31))
    return row.view(np.int32)


@dataclass(frozen=True)
class PrefixMasks:
    """A free prefix's bitmask rows over one vocabulary: the opening masks of its start (empty without one) and
    the blank-only tokens of the answer's leading blanks."""
    opening: dict[str, np.ndarray]
    blanks: np.ndarray


class PrefixGate:
    def __init__(self, prefix: FreePrefix):
        self.start, self.end, self.answer_blanks = prefix.start, prefix.end.encode(), prefix.answer_blanks
        self.phase = FREE if prefix.start is None else UNDECIDED
        self.lead = ""  # undecided: the output's text so far, BLANKS stripped at its start
        self.grammar_alive = True  # undecided: the grammar took every token so far
        self._raw = b""  # undecided: the output's bytes so far
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._window = b""  # free: the last bytes, where `end` may have begun
        self._blank_tokens = 0  # leading blanks: the blank-only tokens taken so far

    def feed(self, data: bytes) -> tuple[bool, bytes | None]:
        """One sampled token's bytes -> (whether the output has just opened its free text: the grammar starts
        over; the bytes of the answer after `end` when the constraint starts with this token, b"" at a token
        boundary, else None). An undecided output that turns out to be the answer moves to CONSTRAINED with
        (False, None): the grammar has taken it all along."""
        opened = False
        if self.phase == UNDECIDED:
            self._raw += data
            self.lead = (self.lead + self._decoder.decode(data)).lstrip(BLANKS)
            phase = route(self.lead, self.start)
            if phase != FREE:
                self.phase = phase
                return False, None
            opened, self.phase = True, FREE
            self.grammar_alive = True  # it starts over on the answer after the free text, which it has all taken
            start = self.start.encode()
            data = self._raw[self._raw.index(start) + len(start):]  # only blanks come before it
            self._raw = b""
        if self.phase != FREE:
            return opened, None
        window = self._window + data
        at = window.find(self.end)
        if at < 0:
            self._window = window[max(0, len(window) - len(self.end) + 1):] if len(self.end) > 1 else b""
            return opened, None
        after = window[at + len(self.end):].lstrip(BLANKS.encode())
        self.phase, self._window = (LEADING_BLANKS if self.answer_blanks and not after else CONSTRAINED), b""
        return opened, after

    def take_blank(self, data: bytes) -> bool:
        """A token of the answer's leading blanks: whether it is one of them (only blanks, within the bound), which
        the grammar does not see; any other is the grammar's, as is every token once this is False."""
        if data and not data.strip(BLANKS.encode()) and self._blank_tokens < MAX_LEADING_BLANK_TOKENS:
            self._blank_tokens += 1
            if self._blank_tokens == MAX_LEADING_BLANK_TOKENS:
                self.phase = CONSTRAINED
            return True
        self.phase = CONSTRAINED
        return False

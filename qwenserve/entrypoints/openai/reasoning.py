"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model's answer split into its reasoning (the text
between `<think>` and `</think>`), returned as the message's `reasoning_content`, and the rest, its `content`.

One splitter serves the whole answer and the streamed one, fed the same text in any cuts, so both give the same
split: a tag cut across two deltas is held back until it is whole. Where the answer starts decides:

- the prompt ends by opening a think block (Qwen3-Thinking-2507's and QwQ's templates end the prompt with
  `<think>` and a newline): the answer starts in the reasoning. Only the prompt's tail counts: a `<think>`
  anywhere else in the conversation is text that the user or a tool wrote;
- otherwise an answer whose first non-blank text is `<think>` starts the reasoning there (Qwen3 with thinking on);
  blanks are JSON's whitespace (BLANKS), as the engine's free prefix counts them;
- otherwise it is all content (Qwen3 with thinking off, whose template closes an empty think block in the
  prompt), and a `</think>` in it is text like any other.

The reasoning ends at `</think>`; an answer cut short inside it (max_tokens) has reasoning and no content.

A constrained answer (structured output, a forced tool call) is constrained after its reasoning, as vLLM does:
the reasoning is the constraint's free prefix (constraint_prefix), which the engine decides by the same rules."""
from __future__ import annotations

from dataclasses import dataclass

from qwenserve.config.errors import ConfigError
from qwenserve.sample.structured_outputs import BLANKS, FreePrefix

# parser name -> (start tag, end tag); vLLM's names
REASONING_PARSERS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}

_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ConfigError(f"reasoning_parser {name!r} is not one of {', '.join(sorted(REASONING_PARSERS))}")


def thinking_open(prompt: str, start: str) -> bool:
    """Whether the generation prompt opens a think block: the rendered prompt ends with the start tag (blanks
    after it aside), so the model continues inside its reasoning. Only the template's tail decides: a start tag
    in the conversation (a user's question about the tag, a tool's description, an earlier turn cut short) is
    text, and never makes the answer reasoning."""
    return prompt.rstrip().endswith(start)


def constraint_prefix(parser: str, prompt: str) -> FreePrefix | None:
    """The free prefix a constrained answer's constraint waits out: its reasoning, already open where the prompt
    opened it, else opened by the answer if it starts with the start tag. None (constrained from the first
    token, as without a parser) where the prompt ends by closing a think block: thinking turned off (Qwen3's
    template with enable_thinking false), so the answer is all content."""
    start, end = REASONING_PARSERS[parser]
    if thinking_open(prompt, start):
        return FreePrefix(end=end)
    if prompt.rstrip().endswith(end):
        return None
    return FreePrefix(end=end, start=start)


def _held_tag_prefix(text: str, tag: str) -> int:
    """How many characters at the end of text could begin `tag` (held back until the next delta decides)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: "Split") -> "Split":
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningSplitter:
    def __init__(self, parser: str, prompt: str = ""):
        """parser: a name in REASONING_PARSERS; prompt: the rendered prompt text, whose tail may open a think
        block."""
        self.start, self.end = REASONING_PARSERS[parser]
        self.state = _REASONING if thinking_open(prompt, self.start) else _BEFORE
        self.saw_reasoning = self.state == _REASONING
        self._held = ""

    def feed(self, text: str) -> Split:
        """The next piece of the answer -> the reasoning and content it releases (a tag cut in two is held)."""
        out = Split()
        text = self._held + text
        self._held = ""
        while text:
            if self.state == _BEFORE:
                lead = text.lstrip(BLANKS)
                if lead.startswith(self.start):
                    self.state, self.saw_reasoning = _REASONING, True
                    text = lead[len(self.start):]
                elif not lead or self.start.startswith(lead):
                    self._held = text  # blank so far, or a cut start tag
                    return out
                else:
                    self.state = _CONTENT
            elif self.state == _REASONING:
                at = text.find(self.end)
                if at >= 0:
                    out.reasoning += text[:at]
                    self.state, text = _CONTENT, text[at + len(self.end):]
                else:
                    hold = _held_tag_prefix(text, self.end)
                    out.reasoning += text[:len(text) - hold]
                    self._held = text[len(text) - hold:]
                    return out
            else:
                out.content += text
                return out
        return out

    def finish(self) -> Split:
        """What is still held when the answer ends: a cut tag is text after all."""
        held, self._held = self._held, ""
        return Split(reasoning=held) if self.state == _REASONING else Split(content=held)

    def split_whole(self, text: str) -> tuple[str | None, str]:
        """A whole answer -> (reasoning, or None where the answer had no reasoning part; content)."""
        out = self.feed(text)
        out += self.finish()
        return (out.reasoning if self.saw_reasoning else None), out.content

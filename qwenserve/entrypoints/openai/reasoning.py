"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model's answer split into its reasoning (the text
between `<think>` and `</think>`), returned as the message's `reasoning_content`, and the rest, its `content`.

One splitter serves the whole answer and the streamed one, fed the same text in any cuts, so both give the same
split: a tag cut across two deltas is held back until it is whole. Where the answer starts decides:

- the answer's turn in the prompt (the text after its assistant header: the generation prompt's think block, or
  the final assistant message that continue_final_message leaves open) is read first, by the same rules, and the
  answer goes on from where it left off: inside the reasoning where it opened a think block and did not close it
  (Qwen3-Thinking-2507's and QwQ's templates end the prompt with `<think>` and a newline; a continued message
  cut inside its reasoning), in the content where it began with text or closed a think block and wrote on. A
  think block the prompt closed with nothing after it (Qwen3 with thinking off, whose template closes an empty
  one) leaves the answer as if the turn were blank. Only that turn counts: a `<think>` anywhere else in the
  conversation is text that the user or a tool wrote;
- otherwise (the turn is still blank) an answer whose first non-blank text is `<think>` starts the reasoning
  there (Qwen3 with thinking on); blanks are JSON's whitespace (BLANKS), as the engine's free prefix counts them;
- otherwise it is all content, and a `</think>` in it is text like any other.

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


# ChatML's header of an assistant turn and its end (every Qwen template's)
ANSWER_HEADER, TURN_END = "<|im_start|>assistant\n", "<|im_end|>"


def answer_so_far(prompt: str, start: str) -> str:
    """The text of the answer's own turn that the prompt already holds: what follows the last assistant header
    where that turn is still open. A prompt with no open assistant turn (another template, a raw prompt) holds
    none, except a tail that opens a think block (the start tag, blanks after it aside)."""
    at = prompt.rfind(ANSWER_HEADER)
    if at >= 0 and TURN_END not in prompt[at:]:
        return prompt[at + len(ANSWER_HEADER):]
    return start if prompt.rstrip().endswith(start) else ""


def thinking_open(parser: str, prompt: str) -> bool:
    """Whether the answer goes on inside a think block the prompt opened."""
    return ReasoningSplitter(parser, prompt).state == _REASONING


def constraint_prefix(parser: str, prompt: str) -> FreePrefix | None:
    """The free prefix a constrained answer's constraint waits out: its reasoning, already open where the prompt
    opened it, else opened by the answer if it starts with the start tag. None (constrained from the first
    token, as without a parser) where the answer's turn in the prompt is already past its reasoning: thinking
    turned off (Qwen3's template with enable_thinking false), or a continued message that closed its think
    block or began with text."""
    start, end = REASONING_PARSERS[parser]
    splitter = ReasoningSplitter(parser, prompt)
    if splitter.state == _REASONING:
        return FreePrefix(end=end)
    return None if splitter.state == _CONTENT or splitter.prompt_closed else FreePrefix(end=end, start=start)


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
        self.state, self.saw_reasoning, self._held = _BEFORE, False, ""
        # the prompt's part of the turn, read for where it leaves the answer (its text is not the answer's)
        after = self.feed(answer_so_far(prompt, self.start)).content
        if self.state == _BEFORE and self._held.strip(BLANKS):
            self.state = _CONTENT  # the turn ends in a cut start tag: text the message wrote
        # a think block the prompt closed with nothing after it (thinking off): the answer may still open one, as
        # it may with thinking on, though a constraint holds from its first token (constraint_prefix)
        self.prompt_closed = self.state == _CONTENT and self.saw_reasoning and not after.strip(BLANKS)
        if self.prompt_closed:
            self.state = _BEFORE
        self._held, self.saw_reasoning = "", self.state == _REASONING

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

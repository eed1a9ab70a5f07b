"""The reasoning splitter (--reasoning-parser qwen3): reasoning and content of whole answers, and the same split
for the same answer streamed in any cuts (tags cut across deltas included)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwenserve.entrypoints.openai.reasoning import ReasoningSplitter, check_reasoning_parser, thinking_open

THINKING_ON = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
THINKING_OFF = THINKING_ON + "<think>\n\n</think>\n\n"
THINKING_OPENED = THINKING_ON + "<think>\n"  # Qwen3-Thinking-2507's template


@pytest.mark.parametrize("prompt, answer, reasoning, content", [
    (THINKING_ON, "<think>\nLet me add.\n</think>\n\n4", "\nLet me add.\n", "\n\n4"),
    (THINKING_ON, "  <think>a</think>b", "a", "b"),
    (THINKING_ON, "4, no reasoning", None, "4, no reasoning"),
    (THINKING_ON, "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    (THINKING_ON, "<think></think>", "", ""),
    (THINKING_ON, "text <think>later</think> is content", None, "text <think>later</think> is content"),
    (THINKING_OFF, "<think>as on</think>", "as on", ""),
    (THINKING_OFF, "a </think> b", None, "a </think> b"),
    (THINKING_OPENED, "reasoning</think>answer", "reasoning", "answer"),
    (THINKING_OPENED, "still thinking", "still thinking", ""),
    (THINKING_ON, "<thin", None, "<thin"),
    (THINKING_ON, "", None, ""),
    (THINKING_ON, "<think>a</thi", "a</thi", ""),
])
def test_whole_answers(prompt, answer, reasoning, content):
    assert ReasoningSplitter("qwen3", prompt).split_whole(answer) == (reasoning, content)


def test_prompt_state_and_parser_names():
    assert thinking_open(THINKING_OPENED, "<think>", "</think>")
    assert not thinking_open(THINKING_OFF, "<think>", "</think>") and not thinking_open(THINKING_ON, "<think>",
                                                                                           "</think>")
    with pytest.raises(ValueError, match="reasoning parser 'nope' is not one of deepseek_r1, qwen3"):
        check_reasoning_parser("nope")


PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "b4", "</thi",
                                   "nk>", "<th"]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(pieces=PIECES, cuts=st.lists(st.integers(0, 80), max_size=6),
       prompt=st.sampled_from([THINKING_ON, THINKING_OFF, THINKING_OPENED]))
def test_streamed_in_any_cuts_equals_whole(pieces, cuts, prompt):
    answer = "".join(pieces)
    whole = ReasoningSplitter("qwen3", prompt).split_whole(answer)
    stream = ReasoningSplitter("qwen3", prompt)
    reasoning = content = ""
    bounds = sorted({min(c, len(answer)) for c in cuts} | {0, len(answer)})
    for a, b in zip(bounds, bounds[1:]):
        out = stream.feed(answer[a:b])
        reasoning, content = reasoning + out.reasoning, content + out.content
    out = stream.finish()
    reasoning, content = reasoning + out.reasoning, content + out.content
    assert ((reasoning if stream.saw_reasoning else None), content) == whole
    assert len(reasoning) + len(content) <= len(answer)

"""The Hermes tool-call parser (Qwen2.5's `<tool_call>` blocks and the model's usual slips), its streaming form,
and the grammar that forces calls: no stubs, plain text in and out."""
import json

import pytest

from qwenserve.entrypoints.openai.protocol import ChatCompletionRequest
from qwenserve.entrypoints.openai.tool_calls import ToolCallStream, forced_call_grammar, parse_tool_calls
from qwenserve.sample.grammar import check_constraint
from qwenserve.sample.structured_outputs import StructuredOutputsParams

NAMES = {"get_weather", "get_time"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def calls(text):
    content, found = parse_tool_calls(text, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
CET = ("get_time", {"zone": "CET"})


@pytest.mark.parametrize("text, content, expected", [
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [PARIS]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", "Let me check.",
     [PARIS, CET]),
    (f"<tool_call>\n{WEATHER}", None, [PARIS]),  # cut before its closing tag
    (f"```json\n{WEATHER}\n```", None, [PARIS]),  # Qwen2.5-Coder's fence
    (f"Sure:\n```\n[{WEATHER}, {TIME}]\n```", "Sure:", [PARIS, CET]),
    (WEATHER, None, [PARIS]),  # bare
    (f"{WEATHER}\n{TIME}", None, [PARIS, CET]),  # several in a row
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}', None, [PARIS]),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ('{"name": "delete_everything", "arguments": {}}', '{"name": "delete_everything", "arguments": {}}', []),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ('```json\n{"a": 1}\n```', '```json\n{"a": 1}\n```', []),
    ("", None, []),
])
def test_parser_takes_the_format_and_the_usual_slips_and_never_raises(text, content, expected):
    assert calls(text) == (content, expected)


@pytest.mark.parametrize("text", [
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
    f"```json\n{WEATHER}\n```",
    WEATHER,
    "Plain text with a < sign and <tool but no call.",
    "  leading space, then a call <tool_call>\n" + WEATHER + "\n</tool_call> and text after",
    "{this looks like JSON but is not}",
])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_content_and_calls_equal_the_whole_answer(text, step):
    stream = ToolCallStream(NAMES)
    sent = "".join(stream.add(text[i:i + step]) for i in range(0, len(text), step))
    rest, streamed_calls = stream.finish()
    content, whole_calls = parse_tool_calls(text, NAMES)
    assert sent + rest == (content or "")
    assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in whole_calls]
    if "<tool_call>" in text and text.index("<tool_call>") > 20:
        assert sent, "text before the call was held back"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("only, parallel", [(None, True), (None, False), ("get_weather", False)])
def test_forced_call_grammar_is_valid(only, parallel):
    tools = [tool for tool in TOOLS if only is None or tool["function"]["name"] == only]
    check_constraint(StructuredOutputsParams(grammar=forced_call_grammar(tools, parallel)))


@pytest.mark.parametrize("tool_choice, forced", [
    ("auto", None), ("none", None), ("required", ["get_weather", "get_time"]),
    ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])])
def test_the_forced_call_grammar_is_built_from_the_tag_ids_given(tool_choice, forced):
    """The server passes the tokenizer's tag ids to sampling_params; the request model keeps no state of its own."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=tool_choice)
    assert body.forces_tool_calls == (forced is not None)
    assert [t["function"]["name"] for t in body.forced_tools() or ()] == (forced or [])
    constraint = body.sampling_params({}, tool_tag_ids=(151657, 151658)).structured_outputs
    if forced is None:
        assert constraint is None
    else:
        assert "<[151657]>" in constraint.grammar and "<[151658]>" in constraint.grammar
        assert body.sampling_params({}).structured_outputs.grammar.count('"<tool_call>"') == 1  # no ids: the text

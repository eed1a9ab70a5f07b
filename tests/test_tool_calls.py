"""The Hermes tool-call parser (Qwen2.5's `<tool_call>` blocks and the model's usual slips), whole and streamed
piece by piece, and the grammar that forces calls: no stubs, plain text in and out."""
import json
import random

import pytest

from qwenserve.entrypoints.openai.protocol import ChatCompletionRequest
from qwenserve.entrypoints.openai.tool_calls import (
    ToolCallDelta,
    ToolCallParser,
    forced_call_grammar,
    parse_tool_calls,
)
from qwenserve.sample.grammar import check_constraint
from qwenserve.sample.structured_outputs import StructuredOutputsParams

from grammar_helpers import Walker

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
    # no call: the text as written, as vLLM's hermes parser returns it; blanks next to a call at an end go
    ("\n\nplain answer\n", "\n\nplain answer\n", []),
    (f"\n\n<tool_call>\n{WEATHER}\n</tool_call>\n", None, [PARIS]),
    (f"  Sure.\n<tool_call>\n{WEATHER}\n</tool_call>\n\n", "  Sure.", [PARIS]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n\nDone.\n", "Done.\n", [PARIS]),
])
def test_parser_takes_the_format_and_the_usual_slips_and_never_raises(text, content, expected):
    assert calls(text) == (content, expected)


@pytest.mark.parametrize("text, content, expected", [
    # cut inside the arguments (max_tokens): the call stays, with what was written, as OpenAI's does
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', None, [("get_weather", '{"city": "Pa')]),
    # cut before the call is certain: text
    ('<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', []),
    # JSON that breaks inside a call already sent: the call ends there, the rest is text
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
     "Paris}}\n</tool_call>", [("get_weather", '{"city": ')]),
    (f"{WEATHER} Shall I?", "Shall I?", [("get_weather", json.dumps(PARIS[1]))]),  # text after bare JSON
    (f"<tool_call>\n{WEATHER}\n<tool_call>\n{TIME}", None,  # a closing tag forgotten
     [("get_weather", json.dumps(PARIS[1])), ("get_time", json.dumps(CET[1]))]),
    ('{"name": "get_time"}', None, [("get_time", "{}")]),  # no arguments
    ('{"name": "get_time", "parameters": {"zone": "CET"}, "id": 3}', None, [("get_time", '{"zone": "CET"}')]),
    ('{"name": "get_time", "arguments": 5}', '{"name": "get_time", "arguments": 5}', []),
    # an integer Python will not convert (over 4300 digits): no ValueError, the call ends there
    ('{"name": "get_time", "arguments": {"a": ' + "9" * 5000 + "}}", "9" * 5000 + "}}", [("get_time", '{"a": ')]),
    # nested past MAX_DEPTH: no recursion error, the call ends where the depth runs out
    ('{"name": "get_time", "arguments": {"a": ' + "[" * 150 + "]" * 150 + "}}", "[" * 51 + "]" * 150 + "}}",
     [("get_time", '{"a": ' + "[" * 99)]),
])
def test_what_a_call_is_where_the_answer_stops_or_breaks(text, content, expected):
    found = parse_tool_calls(text, NAMES)
    assert (found[0], [(c.name, c.arguments) for c in found[1]]) == (content, expected)


def stream(text, step=1):
    """text fed to a ToolCallParser step characters at a time: (the content sent, the calls put together from
    their deltas as a client would, the deltas)."""
    parser, events = ToolCallParser(NAMES), []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    calls = {}
    for d in deltas:
        if d.id is not None:
            assert d.index == len(calls) and d.arguments == "", "a call's first delta: its id and name only"
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
        else:
            assert d.name is None and d.index in calls
            calls[d.index]["arguments"] += d.arguments
    return content, [calls[i] for i in range(len(calls))], deltas


def whole(text):
    content, found = parse_tool_calls(text, NAMES)
    return content or "", [{"name": c.name, "arguments": c.arguments} for c in found]


def assert_stream_equals_whole(text, step):
    content, calls, _ = stream(text, step)
    assert (content, [{k: c[k] for k in ("name", "arguments")} for c in calls]) == whole(text), (text, step)


ANSWERS = [
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
    f"```json\n{WEATHER}\n```",
    WEATHER,
    f"{WEATHER}\n{TIME}",
    f"Sure:\n```\n[{WEATHER}, {TIME}]\n```\nDone.",
    "Plain text with a < sign and <tool but no call.",
    "  leading space, then a call <tool_call>\n" + WEATHER + "\n</tool_call> and text after",
    "{this looks like JSON but is not}",
    '<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}\n</tool_call>',  # name after arguments
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # arguments as JSON text
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut inside the arguments
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',  # breaks after sent
    f"<tool_call>\n{WEATHER}\n<tool_call>\n{TIME}\n</tool_call>",  # a closing tag forgotten
    "```python\nprint({'a': 1})\n```",
    "\n\nplain answer, blanks around it\n ",
    f"\n<tool_call>\n{WEATHER}\n</tool_call>\n\n then text\n",
]


@pytest.mark.parametrize("text", ANSWERS)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_content_and_calls_equal_the_whole_answer(text, step):
    assert_stream_equals_whole(text, step)
    if "<tool_call>" in text and text.index("<tool_call>") > 20:
        assert stream(text, step)[0], "text before the call was held back"


@pytest.mark.parametrize("text", ANSWERS)
def test_every_prefix_streams_as_it_parses_whole(text):
    """An answer may stop anywhere (max_tokens, a stop string): every prefix streamed equals it parsed whole."""
    for end in range(len(text) + 1):
        assert_stream_equals_whole(text[:end], 1)


def test_text_before_a_call_streams_at_once_and_the_call_comes_in_pieces():
    text = f"I will look it up.\n<tool_call>\n{WEATHER}\n</tool_call>"
    parser, sent = ToolCallParser(NAMES), []
    for i, char in enumerate(text):  # token by token, as a model writes it
        sent.append((i, parser.feed(char)))
    sent.append((len(text), parser.finish()))
    content = "".join(e for _, events in sent for e in events if isinstance(e, str))
    assert content == "I will look it up."
    header = next(i for i, events in sent if any(isinstance(e, ToolCallDelta) for e in events))
    assert header < text.index('{"city"') + 1, "the call was not sent as soon as its arguments opened"
    pieces = [e.arguments for _, events in sent for e in events if isinstance(e, ToolCallDelta) and e.id is None]
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Paris", "unit": "celsius"}'


def test_two_calls_split_across_many_small_deltas():
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 40))
        parser, events = ToolCallParser(NAMES), []
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            events += parser.feed(text[a:b])
        events += parser.finish()
        assert not any(isinstance(e, str) for e in events)
        deltas = [e for e in events if isinstance(e, ToolCallDelta)]
        assert [(d.index, d.name) for d in deltas if d.id] == [(0, "get_weather"), (1, "get_time")]
        indexes = [d.index for d in deltas]
        assert indexes == sorted(indexes), "the second call began before the first ended"
        for index, call in enumerate(parser.calls):
            assert "".join(d.arguments for d in deltas if d.index == index) == call.arguments
        assert [json.loads(c.arguments) for c in parser.calls] == [PARIS[1], CET[1]]


@pytest.mark.parametrize("arguments", [
    '{"city": "Paris", "unit": "celsius"}',
    '{ "city" :"Paris" ,\n  "unit":"celsius" }',  # free whitespace
    '{"n": [1, 2.50, -0, 1E3, 1e-2, 12345678901234567890, true, false, null], "empty": {}, "none": []}',
    '{"s": "caf\\u00e9 \\ud83d\\ude00 \\"quoted\\" back\\\\slash \\/ tab\\t nl\\n", "ü": "日本"}',
    '{"deep": {"a": [{"b": [[], [{}]]}]}}',
])
def test_arguments_are_the_canonical_json_of_what_was_written(arguments):
    """Whole or streamed, a call's arguments are json.dumps of the model's arguments object, exactly."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + arguments + '}\n</tool_call>'
    expected = json.dumps(json.loads(arguments), ensure_ascii=False)
    assert whole(text)[1] == [{"name": "get_weather", "arguments": expected}]
    for step in (1, 2, 5):
        assert stream(text, step)[1][0]["arguments"] == expected


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


@pytest.fixture(scope="module")
def walker():
    walker = Walker()
    yield walker
    walker.close()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("parallel", [True, False])
def test_a_forced_answer_may_end_after_every_complete_call(walker, parallel):
    """After a call's closing tag, and after the newline Qwen2.5 writes there, every end-of-turn token is allowed;
    another call may follow only when parallel."""
    grammar = StructuredOutputsParams(grammar=forced_call_grammar(TOOLS, parallel, walker.tag_ids))
    ends, start_tag = {walker.im_end, walker.endoftext}, walker.tag_ids[0]
    matcher = walker.matcher(grammar)
    assert walker.feed(matcher, CALL[:-len("</tool_call>")]) and not ends & walker.allowed(matcher)
    assert walker.feed(matcher, "</tool_call>") and ends <= walker.allowed(matcher)
    assert walker.feed(matcher, "\n")
    assert ends <= walker.allowed(matcher) and (start_tag in walker.allowed(matcher)) == parallel
    if parallel:
        assert walker.feed(matcher, CALL.replace("Paris", "Rome")) and ends <= walker.allowed(matcher)
    assert walker.accepts(grammar, CALL) and walker.accepts(grammar, CALL + "\n")
    assert walker.accepts(grammar, CALL + "\n" + CALL) == parallel


@pytest.mark.parametrize("tool_choice, parallel_tool_calls, parallel", [
    ("required", True, True), ("required", False, False),
    ({"type": "function", "function": {"name": "get_weather"}}, True, False),
    ({"type": "function", "function": {"name": "get_weather"}}, False, False)])
def test_a_named_function_is_called_once_and_required_as_often_as_parallel_allows(tool_choice, parallel_tool_calls,
                                                                                   parallel):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=tool_choice,
                                 parallel_tool_calls=parallel_tool_calls)
    grammar = body.sampling_params({}, tool_tag_ids=(264, 265)).structured_outputs.grammar
    assert grammar == forced_call_grammar(body.forced_tools(), parallel, (264, 265))


FORCED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def forced(text, named=None, step=None):
    """A forced answer's (content, [(name, arguments)]), parsed whole, or streamed step characters at a time."""
    parser = ToolCallParser(NAMES, forced=True, named=named)
    if step is None:
        content, found = parse_tool_calls(text, NAMES, forced=True, named=named)
        return content, [(c.name, c.arguments) for c in found]
    events = [e for i in range(0, len(text), step) for e in parser.feed(text[i:i + step])] + parser.finish()
    content = "".join(e for e in events if isinstance(e, str)) or None
    calls = {}
    for d in (e for e in events if isinstance(e, ToolCallDelta)):
        name, arguments = calls.get(d.index, (d.name, ""))
        calls[d.index] = (name, arguments + d.arguments)
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("cut, named, required", [
    ("<tool_", [("get_weather", "")], []),  # cut before the call's name
    ('<tool_call>\n{"name": "get_wea', [("get_weather", "")], []),  # inside it: "required" cannot know it
    ('<tool_call>\n{"name": "get_weather"', [("get_weather", "")], [("get_weather", "")]),  # after it
    ('<tool_call>\n{"name": "get_weather", "argu', [("get_weather", "")], [("get_weather", "")]),
    ('<tool_call>\n{"name": "get_weather", "arguments": ', [("get_weather", "")], [("get_weather", "")]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', [("get_weather", '{"ci')],
     [("get_weather", '{"ci')]),  # inside the arguments
    (FORCED + '\n<tool_call>\n{"name": "get_t', [("get_weather", '{"city": "Paris"}')],
     [("get_weather", '{"city": "Paris"}')]),  # a second call cut inside its name
])
@pytest.mark.parametrize("step", [None, 1, 4])
def test_a_forced_call_cut_short_is_never_text(cut, named, required, step):
    """tool_choice "required" or a named function: the answer is only calls (the grammar's), so a cut one's markup
    is no text. A call whose name is read is kept with what arguments were written ("" if none); a named
    function's call is kept however early the cut, the request naming it."""
    assert forced(cut, "get_weather", step) == (None, named)
    assert forced(cut, step=step) == (None, required)


def test_every_prefix_of_a_forced_answer_is_calls_only_and_streams_as_it_parses_whole():
    answer = FORCED + "\n" + FORCED.replace("get_weather", "get_time").replace("city", "zone")
    for end in range(len(answer) + 1):
        for named in (None, "get_weather"):
            whole_answer = forced(answer[:end], named)
            assert whole_answer[0] is None and whole_answer == forced(answer[:end], named, step=1), answer[:end]
            if named and answer[:end].strip():
                assert whole_answer[1], answer[:end]
    # not forced ("auto"), a call cut before it is certain stays text, as vLLM's hermes parser leaves it
    assert parse_tool_calls('<tool_call>\n{"name": "get_weather", "argu', NAMES) == (
        '<tool_call>\n{"name": "get_weather", "argu', [])

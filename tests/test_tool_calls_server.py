"""Tool calling through the OpenAI API on the bundled model (Qwen2.5-Coder-0.5B-Instruct), with the official
openai client: a weather round trip (tools in, tool_calls out, the result back, a final answer), forced calls
that always parse, streamed calls whose arguments come in pieces that add up to the whole answer's, and 400s that
name the field."""
import json

import httpx
import pytest

from helpers import bundled_openai_client, bundled_openai_server  # noqa: F401 (fixtures client, server)
from helpers import wait_idle_and_clean as idle_and_clean

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today, in celsius?"}]


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_weather_round_trip(client, server, tool_choice):
    # one call: the 0.5B model, allowed more, calls again and again until max_tokens
    first = client.chat.completions.create(model="qwen", messages=QUESTION, tools=[WEATHER, TIME],
                                           tool_choice=tool_choice, parallel_tool_calls=False, temperature=0.0,
                                           max_tokens=120)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert "paris" in arguments["city"].lower() and arguments["unit"] == "celsius"
    messages = QUESTION + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id,
                            "content": json.dumps({"temperature": 21, "unit": "celsius", "sky": "sunny"})}]
    # tool_choice none: the 0.5B model, still shown the tools, calls them again and again instead of answering
    final = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER, TIME], tool_choice="none",
                                           temperature=0.0, max_tokens=200).choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls, final.message.content
    assert "21" in final.message.content, final.message.content
    idle_and_clean(server[1])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_always_parse(client, tool_choice):
    kwargs = dict(model="qwen", messages=QUESTION, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=120,
                  parallel_tool_calls=False)
    for seed in range(4):  # sampled: the grammar, not luck, makes them parse
        choice = client.chat.completions.create(temperature=1.0, seed=seed, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            assert isinstance(json.loads(call.function.arguments), dict)
        if isinstance(tool_choice, dict):
            assert {c.function.name for c in choice.message.tool_calls} == {"get_time"}


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_call_arguments_come_in_pieces_that_add_up_to_the_whole_answers(client, tool_choice):
    """Each call's first delta carries its index, id, type and name (arguments ""); its arguments follow in
    pieces as they are generated, and put together they are the non-streamed answer's exactly."""
    kwargs = dict(model="qwen", messages=QUESTION, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=120,
                  parallel_tool_calls=False, temperature=0.0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1, whole.message
    calls, pieces, content, finish_reason = {}, 0, "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finish_reason = c.finish_reason or finish_reason
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name and d.function.arguments == "", d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name, d
                    calls[d.index]["arguments"] += d.function.arguments
                    pieces += bool(d.function.arguments)
    assert finish_reason == "tool_calls" and content == (whole.message.content or "")
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls.values()] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]
    assert len(whole.message.tool_calls[0].function.arguments) > 10 and pieces > 3, (pieces, calls)


def streamed(client, **kwargs) -> tuple[str | None, str, list[dict]]:
    """(finish_reason, content, calls) of a streamed answer, each call's deltas joined by their index."""
    calls, content, finish_reason = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finish_reason = c.finish_reason or finish_reason
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    return finish_reason, content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("parallel_tool_calls", [True, False])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_end_where_the_model_ends_them(client, tool_choice, parallel_tool_calls):
    """A named function: exactly one call of it. "required": one call or more, the answer ending where the model
    ends it, not at max_tokens. Both end with finish_reason tool_calls, and streamed deltas joined by index are
    the whole answer's calls."""
    kwargs = dict(model="qwen", messages=QUESTION, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=150,
                  parallel_tool_calls=parallel_tool_calls)
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)):
        whole = client.chat.completions.create(temperature=temperature, seed=seed, **kwargs).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or ()]
        assert whole.finish_reason == "tool_calls" and calls, whole.message
        assert all(isinstance(json.loads(call["arguments"]), dict) for call in calls)
        if isinstance(tool_choice, dict) or not parallel_tool_calls:
            assert len(calls) == 1, calls
        if isinstance(tool_choice, dict):
            assert calls[0]["name"] == "get_weather"
        assert streamed(client, temperature=temperature, seed=seed, **kwargs) == (
            "tool_calls", whole.message.content or "", calls)


def test_tool_choice_none_answers_in_text(client):
    choice = client.chat.completions.create(model="qwen", messages=QUESTION, tools=[WEATHER], tool_choice="none",
                                            temperature=0.0, max_tokens=30).choices[0]
    assert not choice.message.tool_calls and choice.message.content


@pytest.mark.parametrize("endpoint, body, param, message", [
    ("chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not among the tools"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("chat/completions", {"tools": [WEATHER, WEATHER]}, "tools", "same name"),
    ("chat/completions", {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "not both"),
    ("completions", {"tools": [WEATHER]}, "tools", "for chat completions"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, endpoint, body, param, message):
    prompt = {"messages": QUESTION} if endpoint == "chat/completions" else {"prompt": "hi"}
    r = httpx.post(f"{server[0]}/v1/{endpoint}", json={"model": "qwen", "max_tokens": 5} | prompt | body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error

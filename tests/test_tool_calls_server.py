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


def test_tool_choice_none_needs_no_tools(client):
    """As vLLM takes it: "none" asks for no call, so a request without tools may send it."""
    choice = client.chat.completions.create(model="qwen", messages=QUESTION, tool_choice="none", max_tokens=8,
                                            temperature=0).choices[0]
    assert not choice.message.tool_calls and choice.message.content


@pytest.mark.parametrize("endpoint, body, param, message", [
    ("chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not among the tools"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("chat/completions", {"tool_choice": "auto"}, "tool_choice", "needs tools"),
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


# ---- forced calls cut short, on a tiny Qwen3 whose answers the scripted sampler writes ---------------------------

# Qwen3's template, cut down: thinking off closes an empty think block in the prompt
QWEN3_LIKE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "required": ["a"], "additionalProperties": False,
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
DROP = {"type": "function", "function": {"name": "drop", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """(base URL, engine): a tiny Qwen3 with the template above, served with --reasoning-parser qwen3."""
    from helpers import live_server, save_hf_dir, tiny_qwen3

    from qwenserve.config.engine_config import EngineConfig
    from qwenserve.engine.async_engine import AsyncLLMEngine
    from qwenserve.engine.llm_engine import LLMEngine
    from qwenserve.entrypoints.openai.api_server import build_app
    path = save_hf_dir(tiny_qwen3(seed=3), str(tmp_path_factory.mktemp("forced_cut")))
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(QWEN3_LIKE_TEMPLATE)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32",
                                                               kv_cache_memory="32MiB")))
    try:
        with live_server(build_app(engine, ["qwen3"], reasoning_parser="qwen3")) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking_off", "thinking_on"])
@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "pick"}}, "required"],
                         ids=["named", "required"])
def test_a_forced_call_cut_by_max_tokens_is_a_call_never_text(thinking_server, tool_choice, thinking):
    """Cut before its arguments open, a forced call's markup is no content: a named function's call comes with
    arguments "", a "required" call once its name is written; cut inside them, with what was written. Streamed
    deltas carry no content and add up to the whole answer; the reasoning before the call stays."""
    import openai
    from scripted import scripted
    url, engine = thinking_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    tokenizer = engine.tokenizer
    reasoning = "<think>ok</think>" if thinking else ""
    ids = tokenizer.encode(reasoning + '<tool_call>\n{"name": "pick", "arguments": {"a": 3}}\n</tool_call>',
                           add_special_tokens=False) + [tokenizer.eos_token_id]
    named = isinstance(tool_choice, dict)
    kwargs = dict(model="qwen3", messages=[{"role": "user", "content": "hi"}], tools=[PICK, DROP],
                  tool_choice=tool_choice, temperature=0.0, parallel_tool_calls=False,
                  extra_body={} if thinking else {"chat_template_kwargs": {"enable_thinking": False}})
    for cut, calls in (('<tool_call>\n{"name": "pi', [{"name": "pick", "arguments": ""}] if named else []),
                       ('<tool_call>\n{"name": "pick", "argu', [{"name": "pick", "arguments": ""}]),
                       ('<tool_call>\n{"name": "pick", "arguments": {"a', [{"name": "pick", "arguments": '{"a'}])):
        max_tokens = next(k for k in range(len(ids)) if tokenizer.decode(ids[:k]) == reasoning + cut)
        with scripted(ids):
            whole = client.chat.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
            chunks = list(client.chat.completions.create(stream=True, max_tokens=max_tokens, **kwargs))
        message = whole.message
        assert (whole.finish_reason, message.content, getattr(message, "reasoning_content", None),
                [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or ()]
                ) == ("length", None, "ok" if thinking else None, calls), cut
        assert all(c.id and c.type == "function" for c in message.tool_calls or ())
        deltas = [c.delta for chunk in chunks for c in chunk.choices]
        assert not any(d.content for d in deltas), (cut, deltas)
        streamed_calls = {}
        for d in (d for delta in deltas for d in delta.tool_calls or ()):
            call = streamed_calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        streamed_reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) or None
        finish = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
        assert (finish, streamed_reasoning, [streamed_calls[i] for i in sorted(streamed_calls)]) == (
            ["length"], "ok" if thinking else None, calls), cut
    from helpers import wait_idle_and_clean
    wait_idle_and_clean(engine)

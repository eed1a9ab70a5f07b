"""The reasoning splitter (--reasoning-parser qwen3): reasoning and content of whole answers, and the same split
for the same answer streamed in any cuts (tags cut across deltas included)."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwenserve.config.errors import ConfigError
from qwenserve.entrypoints.openai.reasoning import ReasoningSplitter, check_reasoning_parser, thinking_open

THINKING_ON = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
THINKING_OFF = THINKING_ON + "<think>\n\n</think>\n\n"
THINKING_OPENED = THINKING_ON + "<think>\n"  # Qwen3-Thinking-2507's template
CONTINUED_IN_THINK = THINKING_ON + "<think>\nLet me"  # continue_final_message, the message cut in its reasoning


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
    # continue_final_message: the answer goes on where the final assistant message stopped
    (CONTINUED_IN_THINK, " add.</think>\n\n4", " add.", "\n\n4"),
    (CONTINUED_IN_THINK, " think on", " think on", ""),
    (THINKING_ON + "<think>\nplan</think>\n\nThe answer is", " 4", None, " 4"),
    (THINKING_ON + "The answer is", " <think>x</think>", None, " <think>x</think>"),
    (THINKING_ON + " \n", "<think>a</think>b", "a", "b"),
    (THINKING_ON + "<thi", "nk>a</think>b", None, "nk>a</think>b"),
    (CONTINUED_IN_THINK + "</thi", "nk>b", "nk>b", ""),
    # an earlier assistant turn's open think block is closed by its turn's end: this turn starts fresh
    ("<|im_start|>assistant\n<think>\nx<|im_end|>\n" + THINKING_ON, "<think>a</think>b", "a", "b"),
    ("<|im_start|>assistant\n<think>\nx<|im_end|>\n" + THINKING_ON, "a</think>b", None, "a</think>b"),
    ("raw text <think>\n", "a</think>b", "a", "b"),  # no assistant turn: the tail alone opens
])
def test_whole_answers(prompt, answer, reasoning, content):
    assert ReasoningSplitter("qwen3", prompt).split_whole(answer) == (reasoning, content)


def test_prompt_state_and_parser_names():
    assert thinking_open("qwen3", THINKING_OPENED)
    assert not thinking_open("qwen3", THINKING_OFF) and not thinking_open("qwen3", THINKING_ON)
    # a start tag the user (or a tool's description, or an earlier turn) wrote is text: only the tail decides
    for written in ("What does <think> do?", "<think>", "<think>cut off"):
        prompt = THINKING_ON.replace("hi", written)
        assert not thinking_open("qwen3", prompt)
        assert ReasoningSplitter("qwen3", prompt).split_whole("plain") == (None, "plain")
    with pytest.raises(ConfigError, match="reasoning_parser 'nope' is not one of deepseek_r1, qwen3"):
        check_reasoning_parser("nope")


PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "b4", "</thi",
                                   "nk>", "<th"]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(pieces=PIECES, cuts=st.lists(st.integers(0, 80), max_size=6),
       prompt=st.sampled_from([THINKING_ON, THINKING_OFF, THINKING_OPENED, CONTINUED_IN_THINK]))
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


# ---- through the server and the openai client -----------------------------------------------------------------

# Qwen3's template, cut down: an assistant turn's reasoning rendered in a think block; thinking off closes an empty
# think block in the prompt; `opened` (another template variable, as Qwen3-Thinking-2507's template always does)
# leaves one open
QWEN3_LIKE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif opened %}<think>\n{% endif %}{% endif %}"
)
ANSWER = "<think>\nfirst, plan</think>\n\nthe answer"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Qwen3 with the template above behind two live servers: with --reasoning-parser qwen3 and without."""
    from helpers import live_server, save_hf_dir, tiny_qwen3

    from qwenserve.config.engine_config import EngineConfig
    from qwenserve.engine.async_engine import AsyncLLMEngine
    from qwenserve.engine.llm_engine import LLMEngine
    from qwenserve.entrypoints.openai.api_server import build_app
    path = save_hf_dir(tiny_qwen3(seed=3), str(tmp_path_factory.mktemp("thinking")))
    with open(f"{path}/chat_template.jinja", "w") as f:  # where transformers 5 keeps the template
        f.write(QWEN3_LIKE_TEMPLATE)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32",
                                                               kv_cache_memory="32MiB")))
    try:
        with live_server(build_app(engine, ["qwen3"], reasoning_parser="qwen3")) as url, \
                live_server(build_app(engine, ["qwen3"])) as plain_url:
            _served_tokenizer[:] = [engine.tokenizer]
            yield url, plain_url, engine
    finally:
        engine.shutdown()


def client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def ask(url, answer=ANSWER, stream=False, **kwargs):
    """A chat completion whose answer the scripted sampler writes, then ends (a random model writes no tags of
    its own); answer None: the model writes freely (under the request's constraint)."""
    from scripted import scripted
    kwargs = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60} | kwargs
    tokenizer = _served_tokenizer[0]
    script = ([] if answer is None else
              tokenizer.encode(answer, add_special_tokens=False) + kwargs.pop("end_script", [tokenizer.eos_token_id]))
    with scripted(script):
        return _ask(url, stream, kwargs)


_served_tokenizer = []  # the served model's tokenizer (the fixture sets it)


def _ask(url, stream, kwargs):
    if not stream:
        choice = client(url).chat.completions.create(**kwargs).choices[0]
        message = choice.message
        return getattr(message, "reasoning_content", None), message.content, choice.finish_reason, message.tool_calls
    reasoning, content, finish, calls = None, None, None, {}
    for chunk in client(url).chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None)
        if piece:
            reasoning = (reasoning or "") + piece
        if delta.content:
            content = (content or "") + delta.content
        for call in delta.tool_calls or ():
            calls.setdefault(call.index, {"name": None, "arguments": ""})
            calls[call.index]["name"] = call.function.name or calls[call.index]["name"]
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish, [calls[i] for i in sorted(calls)] or None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_content_through_the_openai_client(served, stream):
    url, plain_url, engine = served
    assert ask(url, stream=stream) == ("\nfirst, plan", "\n\nthe answer", "stop", None)
    # cut short inside the reasoning: reasoning only, no content
    reasoning, content, finish, _ = ask(url, stream=stream, max_tokens=16)  # "<think>\nfirst" is 12 tokens
    assert finish == "length" and reasoning and "first, plan".startswith(reasoning.strip()) and content is None
    # no reasoning parser: the answer whole, as content
    assert ask(plain_url, stream=stream) == (None, ANSWER, "stop", None)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_template_kwargs_reach_the_template(served, stream):
    url, _, engine = served
    off = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    assert ask(url, "no thinking here", stream=stream, **off) == (None, "no thinking here", "stop", None)
    opened = {"extra_body": {"chat_template_kwargs": {"opened": True}}}
    assert ask(url, "plan</think>answer", stream=stream, **opened) == ("plan", "answer", "stop", None)
    import httpx
    counts = [httpx.post(f"{url}/tokenize", json={"model": "qwen3", "messages": [{"role": "user", "content": "hi"}],
                                                  "chat_template_kwargs": kwargs}).json()["count"]
              for kwargs in ({}, {"enable_thinking": False}, {"opened": True})]
    assert counts[1] > counts[2] > counts[0]


def test_an_assistant_turns_reasoning_reaches_the_template(served):
    """vLLM passes an assistant message's `reasoning_content` (or its newer name `reasoning`) to the template,
    which renders it (Qwen3's, for the turns of a tool loop); one that is not a string is a 400."""
    import httpx
    url, _, engine = served

    def prompt(**reasoning):
        messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "sunny"} | reasoning,
                    {"role": "user", "content": "sure?"}]
        return httpx.post(f"{url}/tokenize", json={"model": "qwen3", "messages": messages})
    for name in ("reasoning_content", "reasoning"):
        text = engine.tokenizer.decode(prompt(**{name: "I should check"}).json()["tokens"])
        assert "<|im_start|>assistant\n<think>\nI should check\n</think>\n\nsunny<|im_end|>" in text, text
    r = prompt(reasoning_content=["not", "text"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_bad_chat_template_kwargs_are_400s(served):
    import httpx
    url, _, engine = served
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for kwargs, message in (({"tools": []}, "chat_template_kwargs may not set tools"),
                            ({"add_generation_prompt": False}, "may not set add_generation_prompt"),
                            ([1, 2], "chat_template_kwargs"),
                            ({"enable_thinking": "false"}, "enable_thinking must be true or false, got 'false'"),
                            ({"enable_thinking": 0}, "enable_thinking must be true or false, got 0")):
        r = httpx.post(f"{url}/v1/chat/completions", json=body | {"chat_template_kwargs": kwargs})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    from helpers import wait_idle_and_clean
    wait_idle_and_clean(engine)


# ---- a constraint after the reasoning (vLLM's behaviour with a reasoning parser) ---------------------------------

SCHEMA = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                         "b": {"type": "string", "maxLength": 6}}}
JSON_SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}},
               "temperature": 0.0}
OPENED = {"chat_template_kwargs": {"opened": True}}
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def matches_schema(content: str) -> bool:
    value = json.loads(content)
    return set(value) == {"a", "b"} and 0 <= value["a"] <= 999 and len(value["b"]) <= 6


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_after_the_reasoning(served, stream):
    """The scripted reasoning (letters the schema forbids) is written as it is; the content after `</think>` is the
    schema's, whether the prompt opened the think block or the answer opens it."""
    url, _, engine = served
    for answer, extra in (("plan it</think>", OPENED), ("<think>plan it</think>", {})):
        reasoning, content, finish, _ = ask(url, answer, stream=stream, end_script=[], **JSON_SCHEMA,
                                            extra_body=extra)
        assert reasoning == "plan it" and finish == "stop" and matches_schema(content), (reasoning, content)
    # reasoning cut by max_tokens: no constraint ever applied, no content
    reasoning, content, finish, _ = ask(url, "plan it at length, with care</think>", stream=stream, end_script=[],
                                        max_tokens=8, **JSON_SCHEMA, extra_body=OPENED)
    assert (reasoning, content, finish) == ("plan it ", None, "length")
    from helpers import wait_idle_and_clean
    wait_idle_and_clean(engine)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_from_the_first_token_without_thinking(served, stream):
    """Thinking off (the prompt closes the think block), or no reasoning parser: the schema holds from the first
    token, so the script cannot write its reasoning."""
    url, plain_url, engine = served
    for at, extra in ((url, OFF), (plain_url, OPENED)):
        reasoning, content, finish, _ = ask(at, "plan it</think>", stream=stream, end_script=[], **JSON_SCHEMA,
                                            extra_body=extra)
        assert reasoning is None and finish == "stop" and matches_schema(content), (reasoning, content)
    from helpers import wait_idle_and_clean
    wait_idle_and_clean(engine)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_start_tag_in_the_conversation_is_text(served, stream):
    """A `<think>` the user wrote (no `</think>` after it) opens nothing: the answer is content, and the schema
    holds from its first token, as for any thinking-on prompt whose answer does not open a think block."""
    url, _, engine = served
    asked = {"messages": [{"role": "user", "content": "What does the <think> tag do?"}]}
    assert ask(url, "It marks reasoning.", stream=stream, **asked) == (None, "It marks reasoning.", "stop", None)
    reasoning, content, finish, _ = ask(url, '{"a": 1, "b": "x"} and more', stream=stream, end_script=[],
                                        **JSON_SCHEMA, **asked)
    assert (reasoning, content, finish) == (None, '{"a": 1, "b": "x"}', "stop")  # the grammar ends it
    from helpers import wait_idle_and_clean
    wait_idle_and_clean(engine)


def test_a_grammar_that_refuses_the_output_fails_as_the_servers_fault(served, monkeypatch):
    """Whatever the model writes in its free reasoning, the client is not at fault: a grammar that cannot go on
    is a 500 server_error naming no field (the request sent no structured_outputs), whole or streamed."""
    import httpx

    from qwenserve.engine.structured_output import StructuredOutputManager
    url, _, engine = served
    monkeypatch.setattr(StructuredOutputManager, "_through_gate", lambda self, gate, matcher, token, skip: "refused")
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8} | JSON_SCHEMA
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 500 and error["type"] == "server_error" and error["param"] is None, r.text
    assert "could not be kept to the grammar (refused)" in error["message"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["error"]["type"] == "server_error" and chunks[-1]["error"]["param"] is None, chunks[-1]
    from helpers import wait_idle_and_clean
    wait_idle_and_clean(engine)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_after_the_reasoning(served, stream):
    url, _, engine = served
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "required": ["x"], "additionalProperties": False,
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
    reasoning, content, finish, calls = ask(
        url, "which one</think>", stream=stream, end_script=[], max_tokens=120, temperature=0.0, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "pick"}}, extra_body=OPENED)
    assert reasoning == "which one" and finish == "tool_calls" and not content
    call = calls[0] if stream else {"name": calls[0].function.name, "arguments": calls[0].function.arguments}
    assert len(calls) == 1 and call["name"] == "pick" and 0 <= json.loads(call["arguments"])["x"] <= 9
    from helpers import wait_idle_and_clean
    wait_idle_and_clean(engine)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_with_tools_an_answer_with_no_call_is_its_content_as_written(served, stream):
    """Whole and streamed alike, as without tools: the blanks Qwen3 writes after `</think>` stay."""
    url, _, engine = served
    tool = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {}}}}
    assert ask(url, "<think>r</think>\n\nplain answer\n", stream=stream, tools=[tool]) == (
        "r", "\n\nplain answer\n", "stop", None)
    from helpers import wait_idle_and_clean
    wait_idle_and_clean(engine)


def test_several_choices_streamed_split_each_as_whole(served):
    """n=2, streamed: each choice's reasoning and content, joined per index, equal the whole answer's split; the
    reasoning holds text that looks like a cut tag and markup, which stays text."""
    from scripted import scripted
    url, _, engine = served
    answer = "<think>a </thi b <b>x</b> </think\n</think>ok </think> done"
    tokenizer = _served_tokenizer[0]
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 80, "n": 2,
            "temperature": 1.0, "seed": 4}
    with scripted(tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]):
        whole = client(url).chat.completions.create(**body).choices
        joined = {0: ["", ""], 1: ["", ""]}
        for chunk in client(url).chat.completions.create(stream=True, **body):
            for choice in chunk.choices:
                joined[choice.index][0] += getattr(choice.delta, "reasoning_content", None) or ""
                joined[choice.index][1] += choice.delta.content or ""
    expected = ("a </thi b <b>x</b> </think\n", "ok </think> done")
    assert [(c.message.reasoning_content, c.message.content) for c in whole] == [expected] * 2
    assert [tuple(joined[i]) for i in (0, 1)] == [expected] * 2
    from helpers import wait_idle_and_clean
    wait_idle_and_clean(engine)


# ---- the prompt's end: continue_final_message and echo (vLLM's chat fields) ---------------------------------------

CONTINUED = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "The answer is"}]


def test_continue_final_message_leaves_the_final_message_open(served):
    import httpx
    url, plain_url, engine = served
    body = {"model": "qwen3", "messages": CONTINUED, "add_generation_prompt": False}
    closed = engine.tokenizer.decode(httpx.post(f"{plain_url}/tokenize", json=body).json()["tokens"])
    opened = engine.tokenizer.decode(httpx.post(f"{plain_url}/tokenize",
                                                json=body | {"continue_final_message": True}).json()["tokens"])
    assert closed.rstrip().endswith("The answer is<|im_end|>") and opened.endswith("The answer is"), (closed, opened)
    assert ask(plain_url, " 4.", messages=CONTINUED,
               extra_body={"add_generation_prompt": False, "continue_final_message": True})[1] == " 4."
    for endpoint in ("v1/chat/completions", "tokenize"):  # both ends at once: a 400 naming the field
        r = httpx.post(f"{plain_url}/{endpoint}", json=body | {"add_generation_prompt": True,
                                                               "continue_final_message": True, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


IN_THINK = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "<think>\nLet me"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_final_message_continued_inside_its_reasoning(served, stream):
    """continue_final_message on a message cut inside its think block: the answer goes on in the reasoning, and a
    constraint (a schema, a forced tool call) waits for `</think>`; a message past its reasoning goes on in the
    content, constrained from the first token."""
    url, _, engine = served
    assert ask(url, " add.</think>\n\n4", stream=stream, messages=IN_THINK, extra_body=CONTINUE)[:3] == (
        " add.", "\n\n4", "stop")
    reasoning, content, finish, _ = ask(url, " plan it</think>", stream=stream, end_script=[], messages=IN_THINK,
                                        **JSON_SCHEMA, extra_body=CONTINUE)
    assert reasoning == " plan it" and finish == "stop" and matches_schema(content), (reasoning, content)
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "required": ["x"], "additionalProperties": False,
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
    reasoning, content, finish, calls = ask(
        url, " which</think>", stream=stream, end_script=[], max_tokens=120, temperature=0.0, tools=[tool],
        tool_choice="required", parallel_tool_calls=False, messages=IN_THINK, extra_body=CONTINUE)
    assert reasoning == " which" and finish == "tool_calls" and not content and len(calls) == 1, (reasoning, content)
    past = [IN_THINK[0], {"role": "assistant", "content": "The answer is"}]
    reasoning, content, finish, _ = ask(url, "plan it</think>", stream=stream, end_script=[], messages=past,
                                        **JSON_SCHEMA, extra_body=CONTINUE)
    assert reasoning is None and finish == "stop" and matches_schema(content), (reasoning, content)
    from helpers import wait_idle_and_clean
    wait_idle_and_clean(engine)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_empty_reasoning_is_none_whole_and_streamed(served, stream):
    url, _, _ = served
    assert ask(url, "<think></think>4", stream=stream)[:2] == (None, "4")
    cut = len(_served_tokenizer[0].encode("<think>", add_special_tokens=False))  # max_tokens ends on the tag
    assert ask(url, "<think>", stream=stream, max_tokens=cut)[:3] == (None, None, "length")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_starts_the_content_with_the_final_assistant_message(served, stream):
    _, plain_url, _ = served
    continued = {"messages": CONTINUED,
                 "extra_body": {"add_generation_prompt": False, "continue_final_message": True, "echo": True}}
    assert ask(plain_url, " 4.", stream=stream, **continued)[1] == "The answer is 4."
    # the final message is the user's: nothing to echo
    assert ask(plain_url, "4.", stream=stream, extra_body={"echo": True})[1] == "4."


def test_the_offline_chat_takes_vllms_template_fields(tmp_path):
    """LLM.chat renders continue_final_message, chat_template_kwargs and tools as the server does (the prompt is
    the template's own rendering), and refuses the same bad values."""
    from helpers import save_hf_dir, tiny_qwen3

    from qwenserve import LLM, SamplingParams
    from qwenserve.config.errors import RequestError
    path = save_hf_dir(tiny_qwen3(seed=3), str(tmp_path))
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write("{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}" + QWEN3_LIKE_TEMPLATE)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    tool = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {}}}}
    one = SamplingParams(max_tokens=1)
    for fields, ending in ((dict(add_generation_prompt=False, continue_final_message=True), "<think>\nLet me"),
                           (dict(add_generation_prompt=True, chat_template_kwargs={"enable_thinking": False}),
                            "<think>\n\n</think>\n\n")):
        out = llm.chat(IN_THINK, one, use_tqdm=False, tools=[tool], **fields)[0]
        text = llm.get_tokenizer().decode(out.prompt_token_ids)
        assert text.startswith('<|im_start|>system\n[{"type": "function"') and text.endswith(ending), text
        kwargs = fields.pop("chat_template_kwargs", {})
        assert out.prompt_token_ids == llm.get_tokenizer().apply_chat_template(
            IN_THINK, tools=[tool], tokenize=True, return_dict=False, **fields, **kwargs)
    with pytest.raises(RequestError, match="continue_final_message and add_generation_prompt cannot both be true"):
        llm.chat(IN_THINK, one, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tools"):
        llm.chat(IN_THINK, one, chat_template_kwargs={"tools": []})
    with pytest.raises(ValueError, match="enable_thinking must be true or false"):
        llm.chat(IN_THINK, one, chat_template_kwargs={"enable_thinking": "false"})

"""Qwen2.5's tool calls (the Hermes format its chat template asks for) turned into OpenAI `tool_calls`, whole or
streamed, and the grammar that makes `tool_choice` "required" or a named function certain to parse.

The template asks for `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call. Models
also slip: Qwen2.5-Coder often writes the object in a ```json fence, or bare, or several objects in a row. The
parser takes all of these, keeps only calls of the request's tools, and never raises: text that holds no call
comes back as text."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
FENCE = re.compile(r"```(?:json)?\s*(.*?)(?:```|\Z)", re.S)
START_TAG = "<tool_call>"
# JSON as the JSON grammar writes it elsewhere (sample/grammar.py): no free whitespace, the usual separators
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the text that is not a call, stripped, or None if there is none; the calls, in order)."""
    if START_TAG in text:
        calls, kept = [], []
        last = 0
        for block in TOOL_CALL_BLOCK.finditer(text):
            found = _calls_in_json_text(block.group(1), tool_names)
            if found:
                kept.append(text[last:block.start()])
                last = block.end()
                calls += found
        kept.append(text[last:])
        return _content("".join(kept)), calls
    fences = list(FENCE.finditer(text))  # fenced blocks: each must hold calls
    if fences:
        found = [_calls_in_json_text(fence.group(1), tool_names) for fence in fences]
        if all(found):
            return _content(FENCE.sub("", text)), [call for calls in found for call in calls]
    bare = _calls_in_json_text(text, tool_names)  # the whole answer is one or more call objects
    if bare:
        return None, bare
    return _content(text), []


def _content(text: str) -> str | None:
    return text.strip() or None


def _calls_in_json_text(text: str, tool_names: set[str]) -> list[ToolCall]:
    """The calls in text made only of JSON values (objects or lists of them, one after another); [] if anything
    else is there or any value is not a call of a known tool."""
    decoder, calls, pos, text = json.JSONDecoder(), [], 0, text.strip()
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return []
        values = value if isinstance(value, list) else [value]
        for item in values:
            call = _call(item, tool_names)
            if call is None:
                return []
            calls.append(call)
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
    return calls


def _call(value, tool_names: set[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in tool_names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


class ToolCallStream:
    """Streams an answer that may hold tool calls: text is passed on until a call may be starting (a
    `<tool_call>` tag, or an answer that opens like JSON or a fence), then held; at the end the whole answer is
    parsed as parse_tool_calls would, and the rest of the text and every call come out. So the streamed text
    and calls equal the whole answer's."""

    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names
        self.text = ""
        self.sent = 0  # characters of content already passed on
        self.holding = False

    def add(self, delta: str) -> str:
        """The content to send now for this delta of the answer."""
        self.text += delta
        if self.holding:
            return ""
        head = self.text.lstrip()
        if not head:
            return ""
        if self.sent == 0 and head[0] in "{[`":
            self.holding = True
            return ""
        start = len(self.text) - len(head)
        tag = self.text.find(START_TAG)
        if tag >= 0:
            self.holding = True
            end = tag
        else:
            end = len(self.text) - _partial_tag_len(self.text)
        end = start + len(self.text[start:end].rstrip())  # trailing space may precede a call: hold it
        out = self.text[start + self.sent:end] if end > start + self.sent else ""
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not sent yet, the calls) once the answer is complete."""
        content, calls = parse_tool_calls(self.text, self.tool_names)
        return (content or "")[self.sent:], calls


def _partial_tag_len(text: str) -> int:
    """How many characters at text's end could begin a `<tool_call>` tag."""
    for n in range(min(len(START_TAG) - 1, len(text)), 0, -1):
        if START_TAG.startswith(text[-n:]):
            return n
    return 0


def tag_token_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of `<tool_call>` and `</tool_call>` where the vocabulary has each as one token (Qwen2.5's does)."""
    ids = []
    for tag in (START_TAG, "</tool_call>"):
        token_id = tokenizer.convert_tokens_to_ids(tag)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id or tokenizer.decode([token_id]) != tag:
            return None
        ids.append(token_id)
    return ids[0], ids[1]


def forced_call_grammar(tools: list[dict], parallel: bool, tag_ids: tuple[int, int] | None = None) -> str:
    """A Lark grammar (llguidance's, with %json) for answers that are only tool calls in the template's format,
    of any of the tools; one call, or several when parallel. tag_ids: the tags' own tokens, which the grammar
    names by id (llguidance masks such a token by its text, but consumes it as a special token, so a tag written
    as text would reject the very token the mask allowed)."""
    schemas = []
    for tool in tools:
        function = tool["function"]
        schemas.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                        "properties": {"name": {"const": function["name"]},
                                       "arguments": function.get("parameters") or {"type": "object"}}})
    schema = (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}) | {"x-guidance": COMPACT_JSON}
    start, end = (f"<[{tag_ids[0]}]>", f"<[{tag_ids[1]}]>") if tag_ids else ('"<tool_call>"', '"</tool_call>"')
    call = f'call: {start} "\\n" %json {json.dumps(schema)} "\\n" {end}'
    return ('start: call ("\\n" call)*\n' if parallel else "start: call\n") + call + "\n"

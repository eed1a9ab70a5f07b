"""Qwen2.5's tool calls (the Hermes format its chat template asks for) turned into OpenAI `tool_calls`, whole or
streamed, and the grammar that makes `tool_choice` "required" or a named function certain to parse.

The template asks for `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call. Models
also slip: Qwen2.5-Coder often writes the object in a ```json fence, or bare, or several objects in a row. The
parser takes all of these, keeps only calls of the request's tools, and never raises: text that holds no call
comes back as text.

One parser reads the answer character by character, whole (parse_tool_calls) or as it is generated
(ToolCallParser.feed), so a streamed answer's text and calls equal the whole answer's however it is split:

- Calls may start at a `<tool_call>` tag, at a ``` (or ```json) fence whose text opens with `{` or `[`, or at the
  answer's start (bare JSON). JSON values follow, separated by whitespace, commas or semicolons, each a call
  object or a list of them, until the closing tag or fence; whatever else comes there is text again.
- A call object has the `name` of one of the tools and its `arguments` as an object (or as JSON text of one;
  `parameters` is taken for `arguments`; none means `{}`; other keys are ignored).
- A call is sent as soon as it is certain: its name is a tool's and its arguments object opens (or, for
  arguments before the name or as text, once both are read). Until then its text is held; if it turns out not
  to be a call, everything held since the last call is text.
- The arguments are sent as they are written, as canonical JSON: what json.dumps(..., ensure_ascii=False) writes
  of them, ", " and ": " and no other whitespace (json.loads of it gives the model's value). Each piece is sent
  once it is settled (a string character by character, a number or literal once it ends), so the pieces add up
  to the whole answer's `arguments` exactly. An answer that ends inside a call's arguments (max_tokens) keeps
  the call with what was written, as OpenAI does; JSON that breaks inside a call already sent ends the call
  there, and the text from the break on is text.
- A forced answer (tool_choice "required" or a named function, held to forced_call_grammar) is only calls, so
  none of it is text, as with vLLM's forced calls. Cut short (max_tokens, a stop string) before its arguments
  open, a call whose name is read is kept with arguments "", and one cut inside its name is dropped; a named
  function's call is kept however early the answer was cut once it has begun, the request naming it."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

START_TAG, END_TAG, FENCE = "<tool_call>", "</tool_call>", "```"
OPENERS = frozenset("{[")
SEPARATORS = frozenset(" \t\r\n,;")  # between the JSON values of a block
JSON_SPACE = frozenset(" \t\r\n")
ARGUMENT_KEYS = ("arguments", "parameters")
# numbers and the literals json.loads takes; an atom is read whole before it is checked
NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
LITERALS = frozenset({"true", "false", "null", "NaN", "Infinity", "-Infinity"})
ATOM_CHARS = frozenset("+-.0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# string escapes: complete ones, ones that end inside an escape, and a high surrogate (a pair written as two
# escapes is decoded together, so that it becomes one character, as json.loads makes it)
ESCAPES = re.compile(r'(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*')
OPEN_ESCAPE = re.compile(r'(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*\\(?:u[0-9a-fA-F]{0,3})?')
HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")
# JSON as the JSON grammar writes it elsewhere (sample/grammar.py): no free whitespace, the usual separators
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EOF = None  # what the parser reads once the answer has ended
MAX_DEPTH = 100  # JSON nested deeper is not taken as a call's: each level is a generator frame (and a recursion)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A streamed piece of the answer's call number `index`: its first carries the call's id and name (and no
    arguments), the others the next piece of its arguments."""
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str, tool_names: set[str], forced: bool = False,
                     named: str | None = None) -> tuple[str | None, list[ToolCall]]:
    """(the text that is not a call, or None if there is none; the calls, in order). An answer with no call is
    its text as written, as vLLM's hermes parser returns it, unless forced (see ToolCallParser)."""
    parser = ToolCallParser(tool_names, forced, named)
    parser.feed(text)
    parser.finish()
    return parser.content or None, parser.calls


class _NotACall(Exception):
    """What was being read is not a call (or a call already sent breaks off here). Raised with the reading
    position at the first character that is not part of it."""


def _ignore(_: str) -> None:
    pass


class ToolCallParser:
    """Reads an answer as it comes (feed, then finish at its end) and says, for each piece, what to send: text
    (str) and ToolCallDeltas. The text is the answer's as written, calls taken out, except the whitespace between
    a call and an end of the content (before the first text where a call opens the answer, after the last where
    one closes it): the same whole and streamed, and an answer with no call is all text, blanks included.

    The reading is a generator fed one character at a time (EOF at the end); each reader consumes exactly its
    own text and puts back (_unread) the character that ends it, for the next reader. The text between the mark
    and the reading position is held: not yet known to be text or part of a call.

    forced: the answer is held to forced_call_grammar, so it holds no text: what is not a call is a call cut
    short, kept once its name is known. named: the function a named tool_choice forces (forced too), whose call
    is kept even when the answer was cut before its name."""

    def __init__(self, tool_names: set[str], forced: bool = False, named: str | None = None):
        self.tool_names = tool_names
        self.forced = forced or named is not None
        self.named = named
        self.calls: list[ToolCall] = []
        self.content = ""  # the text sent so far
        self._text = ""  # the answer so far
        self._pos = 0  # the next character to read
        self._mark = 0  # the text before it is decided
        self._open: ToolCall | None = None  # a call sent whose JSON has not closed yet
        self._pending: str | None = None  # the name of a call being read, not sent yet
        self._ended = False
        self._space = ""  # whitespace held until more text follows (or the answer ends after text)
        self._after_call = False  # a call came after the last text sent
        self._events: list[str | ToolCallDelta] = []
        self._reader = self._answer()
        next(self._reader)

    def feed(self, delta: str) -> list[str | ToolCallDelta]:
        """What to send now that the answer has grown by delta."""
        self._text += delta
        return self._run()

    def finish(self) -> list[str | ToolCallDelta]:
        """What is left to send once the answer is complete."""
        self._ended = True
        return self._run()

    def _run(self) -> list[str | ToolCallDelta]:
        while self._reader is not None and (self._pos < len(self._text) or self._ended):
            char = EOF
            if self._pos < len(self._text):
                char = self._text[self._pos]
                self._pos += 1
            try:
                self._reader.send(char)
            except StopIteration:
                self._reader = None
        events, self._events = self._events, []
        return events

    # ---- what is decided ---------------------------------------------------------------------------------

    def _unread(self, char) -> None:
        if char is not EOF:
            self._pos -= 1

    def _release(self) -> None:
        """The held text is text."""
        self._say(self._text[self._mark:self._pos])
        self._mark = self._pos

    def _say(self, text: str) -> None:
        if self.forced:  # the grammar allows no text: this is markup of a call cut short
            return
        if not self.content and self.calls:  # the first text after the calls that open the answer: no blanks lead
            text = text.lstrip()
            if not text:
                return
        body = text.rstrip()
        if not body:  # trailing whitespace waits for more text
            self._space += text
            return
        body, self._space = self._space + body, text[len(body):]
        self._emit(body)

    def _emit(self, body: str) -> None:
        self._after_call = False
        self.content += body
        if self._events and isinstance(self._events[-1], str):
            self._events[-1] += body
        else:
            self._events.append(body)

    def _send_call(self, name: str) -> None:
        """The held text is a call of `name`: send its id and name; its arguments follow."""
        if not self.content:  # the blanks before a call that opens the answer are no text
            self._space = ""
        self._after_call = True
        self._mark = self._pos
        self._pending = None
        self._open = ToolCall(name, "", f"call_{uuid.uuid4().hex[:24]}")
        self.calls.append(self._open)
        self._events.append(ToolCallDelta(len(self.calls) - 1, id=self._open.id, name=name))

    def _send_arguments(self, piece: str) -> None:
        self._open.arguments += piece
        last = self._events[-1] if self._events else None
        if isinstance(last, ToolCallDelta) and last.id is None and last.index == len(self.calls) - 1:
            last.arguments += piece
        else:
            self._events.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))

    def _stop(self) -> None:
        """What was being read is not a call: a call already sent ends where its JSON broke (or the answer
        ended), and the text held since the last call is text. A forced call whose name is read is a call."""
        if self.forced and self._open is None and self._pending is not None:
            self._send_call(self._pending)  # its arguments had not opened: none were written
        self._pending = None
        if self._open is not None:
            self._open = None
            self._mark = self._pos
        self._release()

    # ---- the answer --------------------------------------------------------------------------------------

    def _answer(self):
        char = yield
        while char is not EOF and char.isspace():
            char = yield
        self._unread(char)
        if char in OPENERS:
            yield from self._calls_until(None)  # bare JSON
        while True:
            char = yield
            if char is EOF:
                if self.named is not None and not self.calls and self._text.strip():
                    self._send_call(self.named)  # cut before its name was read: the request names it
                    self._open = None
                self._release()
                if self._space and not self._after_call:  # the answer ends in text: its trailing blanks are text
                    self._emit(self._space)
                    self._space = ""
                return
            if char == "<":
                if (yield from self._literal(START_TAG[1:])):
                    yield from self._calls_until(END_TAG)
                    continue
            elif char == "`":
                if (yield from self._fence_opens()):
                    yield from self._calls_until(FENCE)
                    continue
            self._release()

    def _literal(self, rest: str):
        """Whether the next characters are rest (the first that differs is put back)."""
        for expected in rest:
            char = yield
            if char != expected:
                self._unread(char)
                return False
        return True

    def _fence_opens(self):
        """After a backtick: whether it opens a fence of JSON (```, or ```json, then `{` or `[`)."""
        if not (yield from self._literal(FENCE[1:])):
            return False
        char = yield
        if char == "j":
            if not (yield from self._literal("son")):
                return False
            char = yield
        while char is not EOF and char.isspace():
            char = yield
        self._unread(char)
        return char in OPENERS

    def _calls_until(self, closer: str | None):
        """Call values up to closer (END_TAG, FENCE; None for bare JSON, which ends at whatever else comes)."""
        first = len(self.calls)
        try:
            while True:
                at, char = self._pos, (yield)
                if char in SEPARATORS:
                    continue
                if char in OPENERS:
                    self._unread(char)
                    yield from self._call_value()
                    continue
                if closer is not None and char == closer[0]:
                    if (yield from self._literal(closer[1:])) and len(self.calls) > first:
                        self._mark = self._pos  # the block's tags or fences go with its calls
                        return
                    if len(self.calls) == first:  # an empty block: the whole of it is text
                        raise _NotACall
                self._pos = at  # read again as text (it may open the next block, as a forgotten closing tag does)
                raise _NotACall
        except _NotACall:
            self._stop()

    def _call_value(self):
        """A call object or a list of them."""
        char = yield
        if char == "{":
            yield from self._call_object()
            return
        char = yield from self._next()
        while char == "{":
            yield from self._call_object()
            char = yield from self._next()
            if char == "]":
                return
            if char != ",":
                break
            char = yield from self._next()
        self._unread(char)
        raise _NotACall

    def _call_object(self):
        """A call object after its `{`: sent once certain (see the module's doc), its arguments as they come."""
        name = arguments = None  # arguments: their canonical text, while the name is not known
        char = yield from self._next()
        if char == "}":
            raise _NotACall
        self._unread(char)
        while True:
            key = yield from self._string()
            yield from self._expect(":")
            if key == "name" and name is None:
                name = yield from self._string()
                if name not in self.tool_names:
                    raise _NotACall
                if arguments is not None:
                    self._send_call(name)
                    self._send_arguments(arguments)
                elif self._open is None:
                    self._pending = name
            elif key in ARGUMENT_KEYS and arguments is None and self._open is None:
                char = yield from self._next()
                self._unread(char)
                if char == "{" and name is not None:  # certain: send it, then the arguments as they come
                    self._send_call(name)
                    yield from self._value(self._send_arguments)
                    arguments = ""
                else:
                    arguments = yield from self._held_arguments()
                    if name is not None:
                        self._send_call(name)
                        self._send_arguments(arguments)
            else:
                yield from self._value(_ignore)
            char = yield from self._next()
            if char == "}":
                break
            if char != ",":
                self._unread(char)
                raise _NotACall
        if name is None:
            raise _NotACall
        if self._open is None:  # no arguments
            self._send_call(name)
            self._send_arguments("{}")
        self._open = None
        self._mark = self._pos

    def _held_arguments(self):
        """Arguments read whole, as canonical text: an object (before the name is known), or JSON text of one."""
        char = yield from self._next()
        self._unread(char)
        if char == "{":
            pieces = []
            yield from self._value(pieces.append)
            return "".join(pieces)
        text = yield from self._string()
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise _NotACall from None
        if not isinstance(value, dict):
            raise _NotACall
        return json.dumps(value, ensure_ascii=False)

    # ---- JSON, written out canonically as it is read -----------------------------------------------------

    def _next(self):
        """The next character that is not JSON whitespace."""
        char = yield
        while char in JSON_SPACE:
            char = yield
        return char

    def _expect(self, expected: str):
        char = yield from self._next()
        if char != expected:
            self._unread(char)
            raise _NotACall

    def _value(self, out, depth: int = 0):
        """One JSON value, its canonical text given to out piece by piece as each is settled."""
        char = yield from self._next()
        if char in OPENERS:
            if depth == MAX_DEPTH:
                self._unread(char)
                raise _NotACall
            close = "}" if char == "{" else "]"
            out(char)
            char = yield from self._next()
            if char != close:
                self._unread(char)
                while True:
                    if close == "}":
                        yield from self._string(out)
                        yield from self._expect(":")
                        out(": ")
                    yield from self._value(out, depth + 1)
                    char = yield from self._next()
                    if char == close:
                        break
                    if char != ",":
                        self._unread(char)
                        raise _NotACall
                    out(", ")
            out(close)
        elif char == '"':
            self._unread(char)
            yield from self._string(out)
        else:
            self._unread(char)
            yield from self._atom(out)

    def _string(self, out=_ignore):
        """A JSON string: returns its value; out gets its canonical text, a character (or an escape) at a time."""
        char = yield from self._next()
        if char != '"':
            self._unread(char)
            raise _NotACall
        out('"')
        value, escapes = [], ""  # escapes read, not decoded yet: one being read, or a high surrogate awaiting its pair

        def decode():
            text = json.loads(f'"{escapes}"')
            value.append(text)
            out(json.dumps(text, ensure_ascii=False)[1:-1])

        while True:
            char = yield
            if escapes and (char == "\\" or OPEN_ESCAPE.fullmatch(escapes)):
                if char is EOF:
                    raise _NotACall
                escapes += char
                if OPEN_ESCAPE.fullmatch(escapes):
                    continue
                if not ESCAPES.fullmatch(escapes):
                    raise _NotACall
                if escapes.count("\\") == 1 and HIGH_SURROGATE.search(escapes):
                    continue  # its low surrogate may follow: decoded together, they are one character
                decode()
                escapes = ""
                continue
            if escapes:  # a high surrogate with no pair
                decode()
                escapes = ""
            if char == "\\":
                escapes = char
            elif char == '"':
                out('"')
                return "".join(value)
            elif char is EOF or char < " ":  # json.loads takes no raw control character in a string
                self._unread(char)
                raise _NotACall
            else:
                value.append(char)
                out(char)

    def _atom(self, out):
        """A number or a literal (true, false, null, and the NaN and Infinity json.loads takes)."""
        start, word = self._pos, ""
        while True:
            char = yield
            if char not in ATOM_CHARS:
                self._unread(char)
                break
            word += char
        if word in LITERALS:
            out(word)
            return
        try:
            if not NUMBER.fullmatch(word):
                raise ValueError(word)
            out(json.dumps(json.loads(word)))
        except ValueError:  # not a number, or one Python will not convert (an integer of over 4300 digits)
            self._pos = start  # the break is where the word begins
            raise _NotACall from None


def tag_token_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of `<tool_call>` and `</tool_call>` where the vocabulary has each as one token (Qwen2.5's does)."""
    ids = []
    for tag in (START_TAG, END_TAG):
        token_id = tokenizer.convert_tokens_to_ids(tag)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id or tokenizer.decode([token_id]) != tag:
            return None
        ids.append(token_id)
    return ids[0], ids[1]


def forced_call_grammar(tools: list[dict], parallel: bool, tag_ids: tuple[int, int] | None = None) -> str:
    """A Lark grammar (llguidance's, with %json) for answers that are only tool calls in the template's format,
    of any of the tools; one call, or several when parallel. The answer may end after any complete call, with or
    without a newline after its closing tag: Qwen2.5 writes one there and then ends its turn, and a grammar that
    took the newline only as the start of another call made it call again until max_tokens. tag_ids: the tags'
    own tokens, which the grammar names by id (llguidance masks such a token by its text, but consumes it as a
    special token, so a tag written as text would reject the very token the mask allowed)."""
    schemas = []
    for tool in tools:
        function = tool["function"]
        schemas.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                        "properties": {"name": {"const": function["name"]},
                                       "arguments": function.get("parameters") or {"type": "object"}}})
    schema = (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}) | {"x-guidance": COMPACT_JSON}
    start, end = (f"<[{tag_ids[0]}]>", f"<[{tag_ids[1]}]>") if tag_ids else ('"<tool_call>"', '"</tool_call>"')
    call = f'call: {start} "\\n" %json {json.dumps(schema)} "\\n" {end}'
    calls = 'call ("\\n" call)*' if parallel else "call"
    return f'start: {calls} "\\n"?\n{call}\n'

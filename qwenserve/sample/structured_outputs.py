"""What a request's output must match: a JSON schema, any JSON object, a regular expression, one of a list of
strings, or a grammar (Lark or GBNF). Plain data, checked for shape on construction (a bad value raises
RequestError naming the field); whether the schema, regex or grammar itself is valid is checked when the
request is admitted (sample/grammar.py), since that needs the grammar engine.

A constraint may start after a free prefix of the output (FreePrefix: a thinking model's reasoning, which the
server's reasoning parser marks); the engine knows it only as "free text until this marker"
(sample/free_prefix.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from qwenserve.config.errors import RequestError

FIELD = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object")


# the blanks an answer may write before opening its free prefix with `start`: JSON's whitespace, not str.isspace's
# (which takes control characters such as \x1c, text no grammar and no reader takes as blank)
BLANKS = " \t\r\n"


@dataclass(frozen=True)
class FreePrefix:
    """Free text the constraint waits out: it applies from the token after `end`. With `start`, the output may
    open the free text with it (after BLANKS, as the reasoning parsers decide), and one that does not is
    constrained from its first token; without, the output begins inside it (the prompt opened it). With
    answer_blanks, the answer after `end` may start with a few blank-only tokens its grammar does not see (a JSON
    answer or a tool call, where blanks change nothing; a regex or a choice stays exact)."""
    end: str
    start: str | None = None
    answer_blanks: bool = False

    def __post_init__(self):
        for name in ("end", "start"):
            value = getattr(self, name)
            if not (isinstance(value, str) and value) and not (name == "start" and value is None):
                raise RequestError(f"{FIELD}'s free prefix needs {name} as a non-empty string, got {value!r}",
                                   param=FIELD)


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (as a dict or its text)
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None  # Lark, or GBNF as llama.cpp writes it
    json_object: bool | None = None  # any JSON object
    # set by the server, never by a request body: the constraint starts after this prefix (not part of the key)
    free_prefix: FreePrefix | None = None

    def __post_init__(self):
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            found = f"got {', '.join(chosen)}" if chosen else "got none"
            raise RequestError(f"{FIELD} takes exactly one of {', '.join(KINDS)}; {found}", param=FIELD)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise RequestError(f"{FIELD}.json must be a JSON schema (an object or its text), got "
                               f"{type(self.json).__name__}", param=FIELD)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"{FIELD}.{name} must be a non-empty string", param=FIELD)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise RequestError(f"{FIELD}.choice must be a non-empty list of non-empty strings", param=FIELD)
            object.__setattr__(self, "choice", tuple(self.choice))  # hashable, so the key below is
        if self.json_object not in (None, True, False):
            raise RequestError(f"{FIELD}.json_object must be true or false", param=FIELD)
        if self.free_prefix is not None and not isinstance(self.free_prefix, FreePrefix):
            raise RequestError(f"{FIELD}'s free prefix must be a FreePrefix, got {type(self.free_prefix).__name__}",
                               param=FIELD)
        object.__setattr__(self, "_key", self._make_key())  # also checks that a schema's text is JSON

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar is made from, and the compiled grammar cache's key. A schema's text is
        compact JSON in the order the request wrote it: a schema sent as an object or as text, spaced any way,
        gives one key, but the order of its keys is kept, since the grammar writes an object's properties in the
        order its schema lists them (sorting them would make the model write them alphabetically)."""
        return self._key

    def _make_key(self) -> tuple[str, str]:
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = _compact_json(value)
        elif kind == "choice":
            value = json.dumps(list(value))
        elif kind == "json_object":
            value = ""
        return kind, value

    @classmethod
    def from_dict(cls, fields: dict) -> "StructuredOutputsParams":
        """From a request body's object; a key this engine does not know is an error, not ignored (dropping it
        could drop the constraint)."""
        if not isinstance(fields, dict):
            raise RequestError(f"{FIELD} must be an object with one of {', '.join(KINDS)}", param=FIELD)
        unknown = sorted(set(fields) - set(KINDS))
        if unknown:
            raise RequestError(f"{FIELD} has unknown field(s) {', '.join(unknown)}; it takes one of "
                               f"{', '.join(KINDS)}", param=FIELD)
        return cls(**fields)


def _compact_json(schema: str | dict) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"{FIELD}.json is not valid JSON: {e}", param=FIELD) from e
    if not isinstance(schema, dict):
        raise RequestError(f"{FIELD}.json must be a JSON object (a schema), got {type(schema).__name__}",
                           param=FIELD)
    return json.dumps(schema, separators=(",", ":"))  # keys in the request's order: see key

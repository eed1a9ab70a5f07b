"""Errors that name what is wrong, so every entry point can report them without parsing their text."""
from __future__ import annotations


class ConfigError(ValueError):
    """A checkpoint or engine setting that cannot work; the message names the field."""


class RequestError(ValueError):
    """A request that cannot be served as asked. `param` names the offending request field (the OpenAI error's
    `param`), or is None when no single field is to blame."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

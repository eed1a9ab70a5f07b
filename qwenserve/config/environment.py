"""The one place qwenserve reads its environment variables.

A setting declared as `setting(default, help, env="QWENSERVE_X")` takes its default from that variable. The entry
points (the CLI, `LLM(...)`) read the variables once, through `env_defaults`, into the EngineConfig, so worker
processes and Ray actors get the values inside the config they are sent and never look at their own environment.
An explicit value beats the variable; an empty variable counts as unset."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from qwenserve.config.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvValue:
    """A setting's value as read from its variable, with the variable's name and text for error messages."""
    variable: str
    text: str
    value: object

    def __str__(self) -> str:
        return f"{self.variable}={self.text!r}"


def env_variable(f: dataclasses.Field) -> str | None:
    """The variable that gives this setting its default, if it has one."""
    return f.metadata.get("env")


def env_defaults(fields: Iterable[dataclasses.Field], given: Collection[str],
                 environ: Mapping[str, str] | None = None) -> dict[str, EnvValue]:
    """setting name -> its value from the environment, for every field declared with env= that is not among
    `given` and whose variable is set. A value its field cannot parse is a ConfigError naming the variable."""
    environ = os.environ if environ is None else environ
    found = {}
    for f in fields:
        variable = env_variable(f)
        if variable is None or f.name in given:
            continue
        text = environ.get(variable, "").strip()
        if text:
            found[f.name] = EnvValue(variable, text, _parse(f, variable, text))
    return found


def _parse(f: dataclasses.Field, variable: str, text: str) -> object:
    if isinstance(f.default, bool):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{variable}={text!r} is not a boolean for {f.name}: use 1 or 0")
    parse = f.metadata.get("type", str)
    try:
        return parse(text)
    except ValueError:
        raise ConfigError(f"{variable}={text!r} is not a valid {f.name} ({parse.__name__} expected)") from None


def user_cache_dir() -> Path:
    """Where qwenserve keeps what it makes once per machine (the assembled bundled model): $QWENSERVE_CACHE, else
    qwenserve/ under $XDG_CACHE_HOME, else ~/.cache/qwenserve."""
    root = os.environ.get("QWENSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qwenserve")
    return Path(root)

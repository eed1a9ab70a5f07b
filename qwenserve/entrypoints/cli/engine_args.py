"""Flags generated from the config sections' fields (each setting is declared once, in config/): the engine's
for every command that runs one, and the parsers the hand-written flags share."""
from __future__ import annotations

import argparse
import dataclasses

from qwenserve.config.engine_config import EngineConfig, parse_size
from qwenserve.config.environment import env_variable


def add_engine_args(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """A flag for every engine setting (or only the named ones): --block-size for block_size, and
    --enable-prefix-caching / --no-enable-prefix-caching for a boolean."""
    group = parser.add_argument_group("engine arguments")
    for _, f in EngineConfig.settings():
        if only is None or f.name in only:
            add_setting_flag(group, f)


def add_setting_flag(group, f: dataclasses.Field) -> None:
    """The flag of one setting. One with an environment variable leaves no value when not given (the variable,
    read with the others by the config, then gives the default) and names the variable in its help."""
    flag = "--" + f.name.replace("_", "-")
    variable = env_variable(f)
    default = argparse.SUPPRESS if variable else f.default
    help_text = f.metadata["help"] + (f" [env var: {variable}]" if variable else "")
    if variable:  # argparse has no default to put in the help: the field's own stands there
        help_text = help_text.replace("%(default)s", str(f.default))
    if isinstance(f.default, bool):
        group.add_argument(flag, dest=f.name, default=default, action=argparse.BooleanOptionalAction, help=help_text)
    else:
        shape = {key: f.metadata[key] for key in ("nargs", "metavar") if key in f.metadata}
        group.add_argument(flag, dest=f.name, default=default, type=f.metadata.get("type", str), help=help_text,
                           **shape)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config from the parsed flags, with the environment's defaults for the settings not given."""
    return EngineConfig.from_user_settings(**{f.name: getattr(args, f.name) for _, f in EngineConfig.settings()
                                              if hasattr(args, f.name)})


def byte_size(text: str) -> int:
    try:
        value = parse_size(text, "size")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 4MiB, 1048576)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value

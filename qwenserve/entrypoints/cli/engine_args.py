"""Engine flags generated from EngineConfig's fields (each setting is declared once, in config/)."""
from __future__ import annotations

import argparse

from qwenserve.config.engine_config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """A flag for every engine setting (or only the named ones): --block-size for block_size, and
    --enable-prefix-caching / --no-enable-prefix-caching for a boolean."""
    group = parser.add_argument_group("engine arguments")
    for _, f in EngineConfig.settings():
        if only is not None and f.name not in only:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            group.add_argument(flag, dest=f.name, default=f.default, action=argparse.BooleanOptionalAction,
                               help=f.metadata["help"])
        else:
            group.add_argument(flag, dest=f.name, default=f.default, type=f.metadata.get("type", str),
                               help=f.metadata["help"])


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**{f.name: getattr(args, f.name) for _, f in EngineConfig.settings()
                                       if hasattr(args, f.name)})


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value

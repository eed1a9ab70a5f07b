"""The `qwenserve` command: one module per subcommand, each with register(subparsers) and run(args)."""
from __future__ import annotations

import argparse
import logging
import sys

from qwenserve.entrypoints.cli import bench, chat, compare, convert, generate, serve

COMMANDS = {"serve": serve, "chat": chat, "generate": generate, "compare": compare, "convert": convert,
            "bench": bench}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwenserve", description="Serving engine for Qwen2-family models")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return COMMANDS[args.command].run(args)
    except (ValueError, FileExistsError, RuntimeError) as e:
        # bad input, bad checkpoint, missing bundled model: one clear line, no traceback
        print(f"qwenserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

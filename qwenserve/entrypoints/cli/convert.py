"""`qwenserve convert`: any supported checkpoint as an HF-format safetensors directory."""
from __future__ import annotations

import argparse

from qwenserve.entrypoints.cli.engine_args import add_engine_args


def register(sub) -> None:
    p = sub.add_parser("convert", help="write a checkpoint as an HF-format safetensors directory")
    add_engine_args(p, only=("model",))
    p.add_argument("--output", required=True)
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's; bfloat16 for GGUF), float32, ...")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output directory")


def run(args: argparse.Namespace) -> int:
    from qwenserve.tools.convert import convert

    print(convert(args.model, args.output, args.dtype, args.overwrite))
    return 0

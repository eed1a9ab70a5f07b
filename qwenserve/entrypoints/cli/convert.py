"""`qwenserve convert`: any supported checkpoint as an HF-format safetensors directory, with a LoRA adapter merged
in if one is given."""
from __future__ import annotations

import argparse

from qwenserve.entrypoints.cli.engine_args import add_engine_args


def register(sub) -> None:
    p = sub.add_parser("convert", help="write a checkpoint as an HF-format safetensors directory")
    add_engine_args(p, only=("model",))
    p.add_argument("--output", required=True)
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's; bfloat16 for GGUF), float32, ...")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output directory")
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="a PEFT LoRA adapter directory to merge into the weights (W + scaling B A, as PEFT's "
                        "merge_and_unload): the output then answers as the model with that adapter")


def run(args: argparse.Namespace) -> int:
    from qwenserve.tools.convert import convert

    print(convert(args.model, args.output, args.dtype, args.overwrite, args.lora))
    return 0

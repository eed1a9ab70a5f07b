"""`qwenserve convert`: any supported checkpoint as an HF-format safetensors directory, with a LoRA adapter merged
in if one is given, dense or in Qwen's block-wise FP8 layout."""
from __future__ import annotations

import argparse

from qwenserve.entrypoints.cli.engine_args import add_engine_args


def register(sub) -> None:
    p = sub.add_parser("convert", help="write a checkpoint as an HF-format safetensors directory")
    add_engine_args(p, only=("model",))
    p.add_argument("--output", required=True)
    p.add_argument("--dtype", default="auto",
                   help="auto (the checkpoint's; bfloat16 for GGUF), float32, ...: the dense weights' dtype (an FP8 "
                        "checkpoint's are written as its dequantized reference, code x scale, exact in float32)")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="none: dense weights; fp8: every projection in block-wise FP8 as Qwen's *-FP8 checkpoints "
                        "hold them (float8_e4m3fn weight, float32 weight_scale_inv per 128x128 block, "
                        "quantization_config quant_method fp8), the LM head, embeddings and norms in --dtype "
                        "(default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output directory")
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="a PEFT LoRA adapter directory to merge into the weights (W + scaling B A, as PEFT's "
                        "merge_and_unload): the output then answers as the model with that adapter")


def run(args: argparse.Namespace) -> int:
    from qwenserve.tools.convert import convert

    print(convert(args.model, args.output, args.dtype, args.overwrite, args.lora, args.quantization))
    return 0

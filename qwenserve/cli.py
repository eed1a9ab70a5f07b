"""The `qwenserve` command: generate, compare, convert, bench."""
from __future__ import annotations

import argparse
import logging
import sys


def _model_args(p: argparse.ArgumentParser, dtype_default: str = "auto") -> None:
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory or .gguf file (default: the bundled Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--dtype", default=dtype_default, help="auto, float32, bfloat16 or float16 (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwenserve", description="Serving engine for Qwen2-family models")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    _model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="format the prompt as a user message with the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=_positive_int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    gen.add_argument("--seed", type=int, default=None)

    cmp = sub.add_parser("compare", help="greedy decoding in HF transformers vs qwenserve (float32), token by token")
    cmp.add_argument("--model", default=None, help="HF directory or .gguf file (default: the bundled model)")
    cmp.add_argument("--prompts", default=None,
                     help="JSON list (strings or {\"messages\": [...]}) or text file, one prompt per line")
    cmp.add_argument("--max-tokens", type=_positive_int, default=32)
    cmp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    conv = sub.add_parser("convert", help="write a checkpoint as an HF-format safetensors directory")
    conv.add_argument("--model", default=None, help="HF directory or .gguf file (default: the bundled model)")
    conv.add_argument("--output", required=True)
    conv.add_argument("--dtype", default="auto", help="auto (the checkpoint's; bfloat16 for GGUF), float32, ...")
    conv.add_argument("--overwrite", action="store_true", help="replace a non-empty --output directory")
    bench = sub.add_parser("bench", help="benchmarks (speed and memory are measured here, not in tests)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    load = bench_sub.add_parser("load", help="time to load weights and tokenizer")
    _model_args(load)
    load.add_argument("--baseline", choices=["hf"], default=None, help="also time HF transformers on the same file")
    load.add_argument("--json", action="store_true")
    return parser


def cmd_bench(args) -> int:
    from .bench import bench_load, print_result

    if args.bench_command == "load":
        print_result("load time", bench_load(args.model, args.dtype, args.baseline), args.json)
    return 0


def cmd_generate(args) -> int:
    from .model_loader import LoadedModel
    from .simple_generate import SimpleGenerator
    from .tokenizer import chat_prompt_ids

    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    loaded = LoadedModel(args.model, args.dtype, args.max_model_len)
    tok = loaded.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = chat_prompt_ids(tok, messages + [{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt, add_special_tokens=False)
    result = SimpleGenerator(loaded.model, loaded.max_model_len).generate(
        ids, args.max_tokens, args.temperature, stop_token_ids=loaded.stop_token_ids(), seed=args.seed)
    print(tok.decode(result.token_ids, skip_special_tokens=True))
    logging.getLogger("qwenserve").info("%d prompt tokens, %d generated, finish_reason=%s", len(ids),
                                        len(result.token_ids), result.finish_reason)
    return 0


def cmd_compare(args) -> int:
    from .compare import format_table, load_prompts, results_json, run_compare

    results = run_compare(args.model, load_prompts(args.prompts), args.max_tokens)
    print(results_json(results) if args.json else format_table(results))
    return 0 if all(r.equal for r in results) else 1


def cmd_convert(args) -> int:
    from .convert import convert

    print(convert(args.model, args.output, args.dtype, args.overwrite))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    handler = {"generate": cmd_generate, "compare": cmd_compare, "convert": cmd_convert,
               "bench": cmd_bench}[args.command]
    try:
        return handler(args)
    except (ValueError, FileExistsError, RuntimeError) as e:
        # bad input, bad checkpoint, missing bundled model: one clear line, no traceback
        print(f"qwenserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

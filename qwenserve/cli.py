"""The `qwenserve` command: serve, chat, generate, compare, convert, bench."""
from __future__ import annotations

import argparse
import logging
import sys

from .engine_config import EngineConfig


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory or .gguf file (default: the bundled Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a flag (the server takes the same ones)."""
    _model_args(p)
    d = EngineConfig()
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default="2GiB", help="KV cache size, e.g. 2GiB or bytes (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="sequences per step at most (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per step at most; longer prompts are chunked (default: %(default)s)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse KV blocks of repeated prompt prefixes")


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=args.enable_prefix_caching)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwenserve", description="Serving engine for Qwen2-family models")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="model ids clients may ask for (default: the model's id)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health, /metrics)")
    srv.add_argument("--max-waiting-requests", type=_positive_int, default=1024,
                     help="requests queued beyond the running batch before new ones get 503 (default: %(default)s)")

    chat = sub.add_parser("chat", help="interactive chat in the terminal, replies streamed")
    add_engine_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--max-tokens", type=_positive_int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--seed", type=int, default=None)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    add_engine_args(gen)
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

    tput = bench_sub.add_parser("throughput", help="offline throughput: all requests at once, exact output lengths")
    add_engine_args(tput)
    tput.add_argument("--num-prompts", type=_positive_int, default=None,
                      help="requests (default 32, or 64 with --varied)")
    tput.add_argument("--input-len", type=_positive_int, default=128)
    tput.add_argument("--output-len", type=_positive_int, default=64)
    tput.add_argument("--varied", action="store_true",
                      help="prompt lengths 16-512 and output lengths 8-256 (deterministic) instead of fixed ones")
    tput.add_argument("--baseline", choices=["hf"], default=None,
                      help="also run HF transformers (static batches, left padded, run to the longest)")
    tput.add_argument("--hf-batch-size", type=_positive_int, default=32)
    tput.add_argument("--json", action="store_true")

    lat = bench_sub.add_parser("latency", help="one request: time to first token and per output token")
    add_engine_args(lat)
    lat.add_argument("--input-len", type=_positive_int, default=128)
    lat.add_argument("--output-len", type=_positive_int, default=128)
    lat.add_argument("--baseline", choices=["hf"], default=None)
    lat.add_argument("--json", action="store_true")

    pre = bench_sub.add_parser("prefix", help="TTFT with a cached vs an uncached shared prefix")
    add_engine_args(pre)
    pre.add_argument("--prefix-len", type=_positive_int, default=1024)
    pre.add_argument("--num-prompts", type=_positive_int, default=5)
    pre.add_argument("--json", action="store_true")

    bsrv = bench_sub.add_parser("serve", help="drive a running OpenAI-compatible server with streaming requests")
    bsrv.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    bsrv.add_argument("--num-prompts", type=_positive_int, default=64)
    bsrv.add_argument("--input-len", type=_positive_int, default=128)
    bsrv.add_argument("--output-len", type=_positive_int, default=64)
    bsrv.add_argument("--max-concurrency", type=_positive_int, default=None)
    bsrv.add_argument("--request-rate", type=float, default=None, help="requests per second (Poisson arrivals)")
    bsrv.add_argument("--api-key", default=None)
    bsrv.add_argument("--served-model", default=None, help="model id to ask for (default: the server's first)")
    bsrv.add_argument("--max-token-id", type=_positive_int, default=50000,
                      help="prompts are random token ids below this (default: %(default)s)")
    bsrv.add_argument("--json", action="store_true")
    return parser


def cmd_bench(args) -> int:
    from . import bench

    if args.bench_command == "load":
        result = bench.bench_load(args.model, args.dtype, args.baseline)
    elif args.bench_command == "throughput":
        num_prompts = args.num_prompts or (64 if args.varied else 32)
        result = bench.bench_throughput(engine_config_from_args(args), num_prompts, args.input_len,
                                        args.output_len, args.varied, args.baseline, args.hf_batch_size)
    elif args.bench_command == "latency":
        result = bench.bench_latency(engine_config_from_args(args), args.input_len, args.output_len, args.baseline)
    elif args.bench_command == "prefix":
        result = bench.bench_prefix(engine_config_from_args(args), args.prefix_len, args.num_prompts)
    elif args.bench_command == "serve":
        import asyncio

        from .bench_serve import run_bench_serve
        if (args.request_rate is None) == (args.max_concurrency is None):
            raise ValueError("bench serve needs exactly one of --request-rate and --max-concurrency")
        result = asyncio.run(run_bench_serve(args.url, args.num_prompts, args.input_len, args.output_len,
                                             args.max_concurrency, args.request_rate, args.api_key,
                                             args.served_model, max_token_id=args.max_token_id))
    bench.print_result(f"bench {args.bench_command}", result, args.json)
    return 0


def cmd_serve(args) -> int:
    import uvicorn

    from .async_engine import AsyncLLMEngine
    from .engine import LLMEngine
    from .server import OpenAIServer

    engine = AsyncLLMEngine(LLMEngine(engine_config_from_args(args)), max_waiting_requests=args.max_waiting_requests)
    names = args.served_model_name or [engine.engine.loaded.model_id]
    app = OpenAIServer(engine, names, args.api_key).build_app()
    logging.getLogger("qwenserve").info("serving %s at http://%s:%d/v1", ", ".join(names), args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.shutdown()
    return 0


def cmd_chat(args) -> int:
    from .chat_cli import run_chat
    from .sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    run_chat(engine_config_from_args(args), params, args.system)
    return 0


def cmd_generate(args) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(**vars(engine_config_from_args(args)))
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        out = llm.chat(messages + [{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    logging.getLogger("qwenserve").info("%d prompt tokens, %d generated, finish_reason=%s",
                                        len(out.prompt_token_ids), len(out.outputs[0].token_ids),
                                        out.outputs[0].finish_reason)
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
    handler = {"serve": cmd_serve, "chat": cmd_chat, "generate": cmd_generate, "compare": cmd_compare, "convert": cmd_convert,
               "bench": cmd_bench}[args.command]
    try:
        return handler(args)
    except (ValueError, FileExistsError, RuntimeError) as e:
        # bad input, bad checkpoint, missing bundled model: one clear line, no traceback
        print(f"qwenserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

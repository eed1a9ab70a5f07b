"""`qwenserve bench ...`: measurements, never tests (throughput, latency, spec-sweep, prefix, ppl, kernels,
allreduce, load, serve, structured, lora, vl, long-context, passkey), and the shaped models they time
(shaped-gguf)."""
from __future__ import annotations

import argparse
import json

from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.server_config import SERVER_DEFAULTS
from qwenserve.entrypoints.cli.engine_args import add_engine_args, byte_size, engine_config_from_args, positive_int


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (speed and memory are measured here, not in tests)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    load = bench_sub.add_parser("load", help="time to load weights and tokenizer")
    add_engine_args(load, only=("model", "dtype", "cpu_kernels"))
    load.add_argument("--baseline", choices=["hf"], default=None, help="also time HF transformers on the same file")
    load.add_argument("--json", action="store_true")

    tput = bench_sub.add_parser("throughput", help="offline throughput: all requests at once, exact output lengths")
    add_engine_args(tput)
    tput.add_argument("--num-prompts", type=positive_int, default=None,
                      help="requests (default 32, or 64 with --varied)")
    tput.add_argument("--input-len", type=positive_int, default=128)
    tput.add_argument("--output-len", type=positive_int, default=64)
    tput.add_argument("--varied", action="store_true",
                      help="prompt lengths 16-512 and output lengths 8-256 (deterministic) instead of fixed ones")
    tput.add_argument("--baseline", choices=["hf"], default=None,
                      help="also run HF transformers (static batches, left padded, run to the longest)")
    tput.add_argument("--hf-batch-size", type=positive_int, default=32)
    tput.add_argument("--json", action="store_true")

    lat = bench_sub.add_parser("latency", help="one request: time to first token and per output token")
    add_engine_args(lat)
    lat.add_argument("--workload", choices=["random", "code-edit"], default="random",
                     help="random: one prompt of random tokens, run to exactly --output-len tokens; code-edit: the "
                          "shipped code-editing chat prompts (Python code and an edit to make, answered by the whole "
                          "code again), each alone, greedy, to EOS or --output-len, with the speculative decoding "
                          "counters (default: %(default)s)")
    lat.add_argument("--input-len", type=positive_int, default=None, help="random: prompt tokens (default 128)")
    lat.add_argument("--output-len", type=positive_int, default=None,
                     help="output tokens (random: exactly, default 128; code-edit: at most, default 512)")
    lat.add_argument("--baseline", choices=["hf"], default=None)
    lat.add_argument("--json", action="store_true")

    sweep = bench_sub.add_parser("spec-sweep", help="output tokens/s with and without --speculative-config at each "
                                                    "batch size, and their ratio (to set disable_by_batch_size)")
    add_engine_args(sweep)
    sweep.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                       help="requests at once, one run of each engine per size (default: 1 2 4 8 16 32)")
    sweep.add_argument("--workload", choices=["random", "code-edit"], default="random",
                       help="random: the T shape, --input-len random tokens each; code-edit: the shipped code-editing "
                            "tasks, cycled (default: %(default)s)")
    sweep.add_argument("--input-len", type=positive_int, default=128, help="random: prompt tokens (default: 128)")
    sweep.add_argument("--output-len", type=positive_int, default=64,
                       help="output tokens of each request, exactly (default: 64)")
    sweep.add_argument("--json", action="store_true")

    pre = bench_sub.add_parser("prefix", help="TTFT with a cached vs an uncached shared prefix")
    add_engine_args(pre)
    pre.add_argument("--prefix-len", type=positive_int, default=1024)
    pre.add_argument("--num-prompts", type=positive_int, default=5)
    pre.add_argument("--json", action="store_true")

    ppl = bench_sub.add_parser("ppl", help="perplexity of the model over a text (default: one shipped with qwenserve)")
    add_engine_args(ppl)
    ppl.add_argument("--file", default=None, help="a UTF-8 text file (default: English, Chinese and code, ~2.5k tokens)")
    ppl.add_argument("--context", type=positive_int, default=512, help="tokens per window (default: %(default)s)")
    ppl.add_argument("--stride", type=positive_int, default=256,
                     help="tokens scored per window after the first (default: %(default)s)")
    ppl.add_argument("--agreement", action="store_true",
                     help="also run the exact path (quantization none, same dtype; an FP8 checkpoint's is its "
                          "dequantized reference, code x scale) and report its ppl (exact_ppl) and top1_agreement: "
                          "the share of positions where both predict the same next token")
    ppl.add_argument("--reference", action="append", default=[], metavar="PATH",
                     help="another checkpoint of the same model and tokenizer (e.g. the bf16 one an FP8 or "
                          "quantized checkpoint was made from), run with quantization none in the same dtype: its "
                          "ppl and top1_agreement under references; repeat for several")
    ppl.add_argument("--json", action="store_true")

    kern = bench_sub.add_parser("kernels", help="every weight shape of the model: our matmul against the alternatives")
    add_engine_args(kern, only=("model", "dtype", "max_model_len", "device", "quantization", "cpu_kernels",
                                "cpu_isa"))
    kern.add_argument("--rows", type=positive_int, nargs="+", default=[1, 16, 128, 1024],
                      help="batch rows M to time (default: 1 16 128 1024)")
    kern.add_argument("--json", action="store_true")

    ar = bench_sub.add_parser("allreduce", help="one all-reduce between worker processes on this host, per message "
                                               "size (what tensor parallelism pays twice per layer per step)")
    add_engine_args(ar, only=("cpu_omp_threads_bind",))
    ar.add_argument("--world-size", type=positive_int, default=2)
    ar.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    ar.add_argument("--iters", type=positive_int, default=50)
    ar.add_argument("--json", action="store_true")

    from qwenserve.benchmarks.shaped_gguf import SHAPES
    shaped = bench_sub.add_parser("shaped-gguf", help="write a Qwen2.5-1.5B/3B/7B-, Qwen3-1.7B/8B-, Qwen3-30B-A3B- "
                                                      "or Qwen1.5-MoE-A2.7B-shaped GGUF with random weights in "
                                                      "llama.cpp's Q4_K_M type mix, to time (its text is noise)")
    shaped.add_argument("--shape", choices=list(SHAPES), required=True)
    shaped.add_argument("--output", required=True, help="the .gguf file to write")
    shaped.add_argument("--seed", type=int, default=0, help="the same seed writes the same bytes (default: %(default)s)")
    shaped.add_argument("--tokenizer-gguf", default=None,
                        help="a qwen2 GGUF file whose tokenizer and metadata layout to copy (default: the bundled "
                             "model)")
    shaped.add_argument("--layers", type=int, default=None,
                        help="write only the first N decoder layers (block_count N), for quick runs (default: all)")
    shaped.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    shaped.add_argument("--json", action="store_true")

    st = bench_sub.add_parser("structured", help="TPOT with every request under a JSON schema against unconstrained, "
                                                 "and a typical schema's compile time")
    add_engine_args(st)
    st.add_argument("--batch", type=positive_int, default=32, help="requests at once (default: %(default)s)")
    st.add_argument("--max-tokens", type=positive_int, default=64,
                    help="tokens each request writes (default: %(default)s)")
    st.add_argument("--rounds", type=positive_int, default=2,
                    help="alternating runs of each, the median reported (default: %(default)s)")
    st.add_argument("--json", action="store_true")

    lo = bench_sub.add_parser("lora", help="throughput with the requests spread over random LoRA adapters against "
                                           "the base model, and one adapter's load time")
    add_engine_args(lo)
    lo.add_argument("--num-adapters", type=positive_int, default=8, help="adapters in the batch (default: %(default)s)")
    lo.add_argument("--rank", type=positive_int, default=16, help="their rank, on all seven projections "
                                                                   "(default: %(default)s)")
    lo.add_argument("--num-prompts", type=positive_int, default=32)
    lo.add_argument("--input-len", type=positive_int, default=128)
    lo.add_argument("--output-len", type=positive_int, default=64)
    lo.add_argument("--rounds", type=positive_int, default=2,
                    help="alternating runs of each, the median reported (default: %(default)s)")
    lo.add_argument("--json", action="store_true")

    from qwenserve.benchmarks.vl import SHAPES as VL_SHAPES
    vl = bench_sub.add_parser("vl", help="images through a Qwen2-VL-shaped model with random weights (written here): "
                                         "TTFT and the tower's share, the tower's GFLOP/s, throughput, against HF")
    add_engine_args(vl, only=tuple(f.name for _, f in EngineConfig.settings() if f.name != "model"))
    vl.set_defaults(dtype="bfloat16")
    vl.add_argument("--shape", choices=list(VL_SHAPES), default="2B",
                    help="2B: Qwen2-VL-2B-Instruct's sizes; tiny: for tests (default: %(default)s)")
    vl.add_argument("--model-dir", default=None,
                    help="where the checkpoint is written, or reused if a complete one of the shape is there "
                         "(2B: 4.4 GB; default: a temporary directory, removed after)")
    vl.add_argument("--image-size", type=positive_int, default=448, help="square images' side in pixels "
                                                                         "(default: %(default)s)")
    vl.add_argument("--text-len", type=positive_int, default=32, help="text tokens after the image "
                                                                      "(default: %(default)s)")
    vl.add_argument("--num-requests", type=positive_int, default=16,
                    help="requests at once in the throughput run, each with its own image (default: %(default)s)")
    vl.add_argument("--output-len", type=positive_int, default=64,
                    help="tokens each throughput request writes, EOS ignored (default: %(default)s)")
    vl.add_argument("--hf-requests", type=positive_int, default=4,
                    help="requests HF runs one after another for its sequential rate (default: %(default)s)")
    vl.add_argument("--rounds", type=positive_int, default=3,
                    help="alternating TTFT and tower runs of each, the median reported (default: %(default)s)")
    vl.add_argument("--json", action="store_true")

    lc = bench_sub.add_parser("long-context", help="one long prompt's prefill time, TPOT and peak RSS at each length, "
                                                   "without and with dual-chunk attention")
    add_engine_args(lc)
    lc.add_argument("--lengths", type=positive_int, nargs="+", default=[4096, 16384, 32000],
                    help="prompt lengths in tokens, one request each (default: 4096 16384 32000; the bundled model's "
                         "window is 32768 tokens, prompt and output together)")
    lc.add_argument("--output-len", type=positive_int, default=16, help="tokens written after each prompt, for TPOT "
                                                                        "(default: %(default)s)")
    lc.add_argument("--chunk-size", type=positive_int, default=8192,
                    help="DCA's chunk_size, and its original_max_position_embeddings (default: %(default)s)")
    lc.add_argument("--local-size", type=positive_int, default=1024, help="DCA's local_size (default: %(default)s)")
    lc.add_argument("--modes", nargs="+", choices=["no-dca", "dca"], default=["no-dca", "dca"],
                    help="which engines to run; both give the ratios (default: both)")
    lc.add_argument("--json", action="store_true")

    pk = bench_sub.add_parser("passkey", help="retrieval rate of a number hidden at chosen depths of filler text, "
                                              "without DCA, with DCA on a shortened window and with YaRN")
    add_engine_args(pk)
    pk.add_argument("--length", type=positive_int, default=4096, help="prompt tokens (default: %(default)s)")
    pk.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                    help="where the key sits in the filler, 0 first to 1 last (default: 0 0.25 0.5 0.75 1)")
    pk.add_argument("--trials", type=positive_int, default=2, help="keys per depth (default: %(default)s)")
    pk.add_argument("--window", type=positive_int, default=None,
                    help="the shortened window in tokens: DCA's chunk_size and original_max_position_embeddings, "
                         "YaRN's original_max_position_embeddings (default: a quarter of --length)")
    pk.add_argument("--local-size", type=positive_int, default=None,
                    help="DCA's local_size (default: an eighth of the window)")
    pk.add_argument("--modes", nargs="+", choices=["no-dca", "dca", "yarn"], default=["no-dca", "dca", "yarn"],
                    help="which engines to run (default: all three)")
    pk.add_argument("--json", action="store_true")

    srv = bench_sub.add_parser("serve", help="drive a running OpenAI-compatible server with streaming requests")
    srv.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    srv.add_argument("--num-prompts", type=positive_int, default=64)
    srv.add_argument("--input-len", type=positive_int, default=128)
    srv.add_argument("--output-len", type=positive_int, default=64)
    srv.add_argument("--max-concurrency", type=positive_int, default=None)
    srv.add_argument("--request-rate", type=float, default=None, help="requests per second (Poisson arrivals)")
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--served-model", default=None, help="model id to ask for (default: the server's first)")
    srv.add_argument("--max-token-id", type=positive_int, default=50000,
                     help="prompts are random token ids below this (default: %(default)s)")
    srv.add_argument("--storm", action="store_true",
                     help="mix in clients that leave after their first token (10%%) and malformed or hostile "
                          "requests (5%%: n=100000, invalid JSON, huge max_tokens, wrong types, an unknown role, a "
                          "body over the server's limit); adds valid requests lost and bad requests answered 4xx")
    srv.add_argument("--max-request-bytes", type=byte_size, default=SERVER_DEFAULTS.max_request_bytes,
                     help="the server's --max-request-bytes: the storm's oversized body is one byte more "
                          "(default: %(default)s)")
    srv.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from qwenserve.benchmarks.common import print_result

    if args.bench_command == "load":
        from qwenserve.benchmarks.load import bench_load
        load = engine_config_from_args(args).load
        result = bench_load(load.model, load.dtype, args.baseline, load.cpu_kernels)
    elif args.bench_command == "throughput":
        from qwenserve.benchmarks.throughput import bench_throughput
        num_prompts = args.num_prompts or (64 if args.varied else 32)
        result = bench_throughput(engine_config_from_args(args), num_prompts, args.input_len, args.output_len,
                                  args.varied, args.baseline, args.hf_batch_size)
    elif args.bench_command == "latency" and args.workload == "code-edit":
        from qwenserve.benchmarks.code_edit import bench_code_edit
        for flag, value in (("--input-len", args.input_len), ("--baseline", args.baseline)):
            if value is not None:
                raise ValueError(f"bench latency --workload code-edit takes no {flag} (its prompts are the shipped "
                                 f"tasks, on qwenserve alone)")
        result = bench_code_edit(engine_config_from_args(args), args.output_len or 512)
    elif args.bench_command == "latency":
        from qwenserve.benchmarks.latency import bench_latency
        result = bench_latency(engine_config_from_args(args), args.input_len or 128, args.output_len or 128,
                               args.baseline)
    elif args.bench_command == "spec-sweep":
        from qwenserve.benchmarks.spec_sweep import bench_spec_sweep
        result = bench_spec_sweep(engine_config_from_args(args), args.batch_sizes, args.workload, args.input_len,
                                  args.output_len)
    elif args.bench_command == "prefix":
        from qwenserve.benchmarks.prefix import bench_prefix
        result = bench_prefix(engine_config_from_args(args), args.prefix_len, args.num_prompts)
    elif args.bench_command == "kernels":
        from qwenserve.benchmarks.kernels import bench_kernels, format_table
        result = bench_kernels(engine_config_from_args(args), tuple(args.rows))
        print(json.dumps(result) if args.json else format_table(result))
        return 0
    elif args.bench_command == "allreduce":
        from qwenserve.benchmarks.allreduce import bench_allreduce, format_table
        result = bench_allreduce(args.world_size, args.dtype, args.iters,
                                 engine_config_from_args(args).parallel.cpu_omp_threads_bind)
        print(json.dumps(result) if args.json else format_table(result))
        return 0
    elif args.bench_command == "shaped-gguf":
        from qwenserve.benchmarks.shaped_gguf import SHAPES, write_shaped_gguf
        if not args.output.endswith(".gguf"):
            raise ValueError(f"--output {args.output} must end in .gguf (the loaders know GGUF files by it)")
        result = write_shaped_gguf(SHAPES[args.shape], args.output, args.seed, args.tokenizer_gguf, args.overwrite,
                                   layers=args.layers)
    elif args.bench_command == "structured":
        from qwenserve.benchmarks.structured import bench_structured
        result = bench_structured(engine_config_from_args(args), args.batch, args.max_tokens, args.rounds)
    elif args.bench_command == "lora":
        from qwenserve.benchmarks.lora import bench_lora
        result = bench_lora(engine_config_from_args(args), args.num_adapters, args.rank, args.num_prompts,
                            args.input_len, args.output_len, args.rounds)
    elif args.bench_command == "vl":
        from qwenserve.benchmarks.vl import SHAPES, bench_vl
        settings = {f.name: getattr(args, f.name) for _, f in EngineConfig.settings() if hasattr(args, f.name)}
        result = bench_vl(settings, SHAPES[args.shape], args.model_dir, args.image_size, args.text_len,
                          args.num_requests, args.output_len, args.hf_requests, args.rounds)
    elif args.bench_command == "long-context":
        from qwenserve.benchmarks.long_context import bench_long_context, format_table
        dca = {"chunk_size": args.chunk_size, "local_size": args.local_size,
               "original_max_position_embeddings": args.chunk_size}
        result = bench_long_context(engine_config_from_args(args), args.lengths, args.output_len, dca,
                                    tuple(args.modes))
        print(format_table(result))
        if args.json:
            print(json.dumps(result))
        return 0
    elif args.bench_command == "passkey":
        from qwenserve.benchmarks.passkey import bench_passkey
        window = args.window or max(args.length // 4, 2)
        result = bench_passkey(engine_config_from_args(args), args.length, args.depths, args.trials, window,
                               args.local_size or max(window // 8, 1), args.modes)
    elif args.bench_command == "ppl":
        from qwenserve.benchmarks.ppl import bench_ppl
        result = bench_ppl(engine_config_from_args(args), args.file, args.context, args.stride, args.agreement,
                           args.reference)
    else:
        import asyncio

        from qwenserve.benchmarks.serve import run_bench_serve
        if (args.request_rate is None) == (args.max_concurrency is None):
            raise ValueError("bench serve needs exactly one of --request-rate and --max-concurrency")
        result = asyncio.run(run_bench_serve(args.url, args.num_prompts, args.input_len, args.output_len,
                                             args.max_concurrency, args.request_rate, args.api_key,
                                             args.served_model, max_token_id=args.max_token_id, storm=args.storm,
                                             max_request_bytes=args.max_request_bytes))
    print_result(f"bench {args.bench_command}", result, args.json)
    return 0

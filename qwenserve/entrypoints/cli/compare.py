"""`qwenserve compare`: greedy decoding in HF transformers vs qwenserve (float32), token by token."""
from __future__ import annotations

import argparse

from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args, positive_int


def register(sub) -> None:
    p = sub.add_parser("compare", help="greedy decoding in HF transformers vs qwenserve (float32), token by token")
    add_engine_args(p, only=("model", "cpu_kernels"))
    p.add_argument("--prompts", default=None,
                   help="JSON list (strings or {\"messages\": [...]}) or text file, one prompt per line")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from qwenserve.tools.compare import format_table, load_prompts, results_json, run_compare

    load = engine_config_from_args(args).load
    results = run_compare(load.model, load_prompts(args.prompts), args.max_tokens, load.cpu_kernels)
    print(results_json(results) if args.json else format_table(results))
    return 0 if all(r.equal for r in results) else 1

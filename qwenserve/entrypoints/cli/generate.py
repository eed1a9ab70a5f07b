"""`qwenserve generate`: complete one prompt through the engine and print the result."""
from __future__ import annotations

import argparse
import logging

from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args, positive_int


def register(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt and print the result")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="format the prompt as a user message with the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--seed", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    from qwenserve.entrypoints.llm import LLM
    from qwenserve.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(config=engine_config_from_args(args))
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

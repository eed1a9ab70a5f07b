"""`qwenserve chat`: an interactive terminal chat that streams the reply as it is generated."""
from __future__ import annotations

import argparse
import itertools
import sys

from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.data_parallel import build_engine
from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args, positive_int
from qwenserve.model.loader.tokenizer import chat_prompt_ids
from qwenserve.sample.sampling_params import SamplingParams


def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat in the terminal, replies streamed")
    add_engine_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=positive_int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    run_chat(engine_config_from_args(args), params, args.system)
    return 0


def run_chat(config: EngineConfig, params: SamplingParams, system: str | None = None, read=input,
             out=sys.stdout) -> list[dict]:
    """Reads user turns with read() until EOF or /exit; returns the conversation."""
    engine = build_engine(config)
    messages = [{"role": "system", "content": system}] if system else []
    out.write("Chatting with %s. /exit or Ctrl-D quits, /reset starts over.\n" % engine.model_id)
    for turn in itertools.count():
        try:
            line = read(">>> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            engine.add_request(f"chat-{turn}", {"prompt_token_ids": chat_prompt_ids(engine.tokenizer, messages)},
                               params)
        except ValueError as e:  # e.g. the conversation no longer fits the context
            out.write(f"error: {e}\n")
            messages.pop()
            continue
        reply = []
        try:
            while engine.has_unfinished_requests():
                for o in engine.step():
                    out.write(o.outputs[0].text_delta)
                    out.flush()
                    reply.append(o.outputs[0].text_delta)
        except KeyboardInterrupt:  # stop this reply, keep the chat
            engine.abort_request(f"chat-{turn}")
        out.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return messages

"""`qwenserve chat`: an interactive terminal chat that streams the reply as it is generated."""
from __future__ import annotations

import itertools
import sys

from .engine import LLMEngine
from .engine_config import EngineConfig
from .sampling_params import SamplingParams
from .tokenizer import chat_prompt_ids


def run_chat(config: EngineConfig, params: SamplingParams, system: str | None = None, read=input,
             out=sys.stdout) -> list[dict]:
    """Reads user turns with read() until EOF or /exit; returns the conversation."""
    engine = LLMEngine(config)
    messages = [{"role": "system", "content": system}] if system else []
    out.write("Chatting with %s. /exit or Ctrl-D quits, /reset starts over.\n" % engine.loaded.model_id)
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

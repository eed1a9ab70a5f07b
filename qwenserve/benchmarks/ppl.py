"""`qwenserve bench ppl`: perplexity of the loaded model over a text, the measure users of quantized models
expect (lower is better; compare variants of one model on one text, never across tokenizers).

Sliding windows of `context` tokens moved by `stride`: the first window scores every token after its first,
each later one only its last `stride` tokens, so every token is scored once with at least context - stride
tokens before it. The scores are the engine's own prompt logprobs, so this measures exactly the path served.
The default text ships with the package: about 2,500 tokens of English prose, Chinese prose and code."""
from __future__ import annotations

import math
from pathlib import Path

from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.sample.sampling_params import SamplingParams

DEFAULT_TEXT = Path(__file__).with_name("data") / "ppl_default.txt"


def windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window; together they score tokens 1..num_tokens-1 once."""
    spans = [(0, min(context, num_tokens), 1)]
    scored_to = spans[0][1]
    while scored_to < num_tokens:
        end = min(scored_to + stride, num_tokens)
        spans.append((max(end - context, 0), end, scored_to))
        scored_to = end
    return spans


def bench_ppl(config: EngineConfig, path: str | None = None, context: int = 512, stride: int = 256) -> dict:
    if not 0 < stride < context:
        raise ValueError(f"bench ppl needs 0 < stride < context, got stride {stride}, context {context}")
    engine = LLMEngine(config)
    text = Path(path or DEFAULT_TEXT).read_text(encoding="utf-8")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < 2:
        raise ValueError(f"{path or DEFAULT_TEXT}: needs at least 2 tokens to score, has {len(ids)}")
    context = min(context, engine.max_model_len - 1)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    spans = windows(len(ids), context, min(stride, context - 1))
    for i, (start, end, _) in enumerate(spans):
        engine.add_request(f"ppl-{i}", {"prompt_token_ids": ids[start:end]}, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    nll, scored = 0.0, 0
    for i, (start, end, first) in enumerate(spans):
        logprobs = finals[f"ppl-{i}"].prompt_logprobs  # entry j: the logprob of token start + j
        for pos in range(first - start, end - start):
            nll -= logprobs[pos][ids[start + pos]].logprob
            scored += 1
    return {"ppl": round(math.exp(nll / scored), 4), "tokens": scored, "text": str(path or DEFAULT_TEXT),
            "context": context, "stride": stride, "quantization": engine.spec.quantization,
            "dtype": str(engine.spec.dtype).removeprefix("torch.")}

"""`qwenserve bench ppl`: perplexity of the loaded model over a text, the measure users of quantized models
expect (lower is better; compare variants of one model on one text, never across tokenizers).

Sliding windows of `context` tokens moved by `stride`: the first window scores every token after its first,
each later one only its last `stride` tokens, so every token is scored once with at least context - stride
tokens before it. The scores are the engine's own prompt logprobs, so this measures exactly the path served.
The default text ships with the package: about 2,500 tokens of English prose, Chinese prose and code.

Against what: --agreement runs the exact path of the same checkpoint (quantization none, same dtype: an FP8
checkpoint's dequantized reference, code x scale, or a GGUF file's dequantized blocks); each --reference runs
another checkpoint of the same model and tokenizer (e.g. the bf16 one an FP8 checkpoint was made from) the same
way. Each reports its ppl and top-1 agreement with the model measured, on the same windows of the same tokens."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.model.loader.resolve import tokenizer_difference
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


def bench_ppl(config: EngineConfig, path: str | None = None, context: int = 512, stride: int = 256,
              agreement: bool = False, references: list[str] = ()) -> dict:
    """agreement: also run the exact path (the same model and dtype with quantization none) over the same windows
    and report its ppl (exact_ppl) and top1_agreement, the share of scored positions where both predict the same
    next token: a measure of how far a quantization moves greedy decoding that a few prompts' near-ties cannot
    swing. references: other checkpoints of the model (same tokenizer), each run so too (quantization none, the
    measured run's dtype): their ppl and top1_agreement under `references`."""
    if not 0 < stride < context:
        raise ValueError(f"bench ppl needs 0 < stride < context, got stride {stride}, context {context}")
    engine = LLMEngine(config)
    text = Path(path or DEFAULT_TEXT).read_text(encoding="utf-8")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < 2:
        raise ValueError(f"{path or DEFAULT_TEXT}: needs at least 2 tokens to score, has {len(ids)}")
    context = min(context, engine.max_model_len - 1)
    spans = windows(len(ids), context, min(stride, context - 1))
    nll, top1 = _score(engine, ids, spans)
    result = {"ppl": round(math.exp(nll / len(top1)), 4), "tokens": len(top1), "text": str(path or DEFAULT_TEXT),
              "context": context, "stride": stride, "quantization": engine.resolved_model.quantization,
              "dtype": str(engine.resolved_model.dtype).removeprefix("torch.")}
    tokenizer, dtype = engine.tokenizer, result["dtype"]
    engine.shutdown()  # one engine's weights in memory at a time
    if agreement:
        exact = LLMEngine(dataclasses.replace(config, load=dataclasses.replace(config.load, quantization="none")))
        exact_nll, exact_top1 = _score(exact, ids, spans)
        exact.shutdown()
        result["exact_ppl"] = round(math.exp(exact_nll / len(top1)), 4)
        result["top1_agreement"] = _agreement(top1, exact_top1)
    if references:
        result["references"] = []
    for reference in references:
        load = dataclasses.replace(config.load, model=reference, quantization="none", dtype=dtype, hf_overrides=None)
        other = LLMEngine(dataclasses.replace(config, load=load))
        difference = tokenizer_difference(tokenizer, other.tokenizer)
        if difference:
            other.shutdown()
            raise ValueError(f"--reference {reference} has another tokenizer than the model measured ({difference}); "
                             "a reference must be the same model's")
        ref_nll, ref_top1 = _score(other, ids, spans)
        other.shutdown()
        result["references"].append({"model": reference, "ppl": round(math.exp(ref_nll / len(top1)), 4),
                                     "top1_agreement": _agreement(top1, ref_top1)})
    return result


def _agreement(top1: list[int], other: list[int]) -> float:
    return round(sum(a == b for a, b in zip(top1, other)) / len(top1), 4)


def _score(engine: LLMEngine, ids: list[int], spans: list[tuple[int, int, int]]) -> tuple[float, list[int]]:
    """The summed NLL of every scored token, and at each scored position the token the model found most likely."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    for i, (start, end, _) in enumerate(spans):
        engine.add_request(f"ppl-{i}", {"prompt_token_ids": ids[start:end]}, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    nll, top1 = 0.0, []
    for i, (start, end, first) in enumerate(spans):
        logprobs = finals[f"ppl-{i}"].prompt_logprobs  # entry j: token start + j's logprob and the most likely
        for pos in range(first - start, end - start):
            nll -= logprobs[pos][ids[start + pos]].logprob
            top1.append(next(t for t, lp in logprobs[pos].items() if lp.rank == 1))
    return nll, top1

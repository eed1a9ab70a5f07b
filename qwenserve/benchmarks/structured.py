"""`qwenserve bench structured`: what structured output costs. TPOT at batch B with every request under a JSON
schema against the same batch unconstrained, back to back and alternating, at temperature 0 and 1; and the time
from a typical schema (5 fields, one nested) to its first token mask in the engine's own compiler, cold and cached.

Every request writes exactly max_tokens tokens either way, so the two runs do the same work but for the grammar:
unconstrained ones ignore EOS, constrained ones follow a schema whose one string needs more characters than
max_tokens tokens hold."""
from __future__ import annotations

import itertools
import statistics
import time

from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.model.loader.tokenizer import chat_prompt_ids
from qwenserve.sample.sampling_params import SamplingParams
from qwenserve.sample.structured_outputs import StructuredOutputsParams

LONG_SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}}, "required": ["story"]}
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"]},
    },
    "required": ["name", "age", "active", "tags", "address"],
}
TOPICS = ["the sea", "a city", "a robot", "a forest", "the moon", "a violin", "a storm", "a library"]
WARM_UP_REQUESTS = 4


def bench_structured(config: EngineConfig, batch: int, max_tokens: int, rounds: int) -> dict:
    if batch > config.scheduler.max_num_seqs:
        raise ValueError(f"--batch {batch} is more than the {config.scheduler.max_num_seqs} sequences a step runs "
                         "(--max-num-seqs): the batch would not run at once")
    if max_tokens < 2:
        raise ValueError("--max-tokens must be at least 2 (TPOT is measured between the first and last token)")
    engine = LLMEngine(config)
    try:
        prompts = [chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": f"Write a story about "
                                                       f"{TOPICS[i % len(TOPICS)]} (#{i}) as JSON."}])
                   for i in range(batch)]
        compiler = engine.structured_output.compiler
        # the vocabulary (once per engine, seconds) is built first: it is not what a request's compile costs
        compiler.compile(StructuredOutputsParams(json={"type": "object"})).result()
        cold, cached = compile_ms(compiler, TYPICAL_SCHEMA)
        result = {"batch": batch, "max_tokens": max_tokens, "rounds": rounds,
                  "compile_cold_ms": round(cold, 2), "compile_cached_ms": round(cached, 3)}
        ids = itertools.count()
        for temperature in (0.0, 1.0):
            base = dict(temperature=temperature, seed=0, max_tokens=max_tokens)
            plain = SamplingParams(ignore_eos=True, **base)
            constrained = SamplingParams(structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA), **base)
            tpot_ms(engine, ids, prompts[:WARM_UP_REQUESTS], plain)
            tpot_ms(engine, ids, prompts[:WARM_UP_REQUESTS], constrained)
            runs = {"unconstrained": [], "json_schema": []}
            for _ in range(rounds):  # alternating, so that drift on a shared machine hits both alike
                runs["unconstrained"].append(tpot_ms(engine, ids, prompts, plain))
                runs["json_schema"].append(tpot_ms(engine, ids, prompts, constrained))
            unconstrained, json_schema = (statistics.median(v) for v in runs.values())
            t = f"t{temperature:g}"
            result |= {f"tpot_unconstrained_ms_{t}": round(unconstrained, 2),
                       f"tpot_json_schema_ms_{t}": round(json_schema, 2),
                       f"ratio_{t}": round(json_schema / unconstrained, 3),
                       f"rounds_unconstrained_ms_{t}": [round(x, 1) for x in runs["unconstrained"]],
                       f"rounds_json_schema_ms_{t}": [round(x, 1) for x in runs["json_schema"]]}
        return result
    finally:
        engine.shutdown()


def tpot_ms(engine: LLMEngine, ids, prompts: list[list[int]], params: SamplingParams) -> float:
    """All prompts at once; the mean over requests of (last token - first token) / (tokens - 1), in ms."""
    request_ids = [f"structured-{next(ids)}" for _ in prompts]
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    per_request = []
    for request_id in request_ids:
        out = finals[request_id]
        n = len(out.outputs[0].token_ids)
        if n != params.max_tokens:  # the two runs would not do the same work
            raise RuntimeError(f"a request wrote {n} tokens, not max_tokens={params.max_tokens}: "
                               f"{out.outputs[0].text[:80]!r}")
        per_request.append((out.metrics.finished_time - out.metrics.first_token_time) / (n - 1) * 1e3)
    return statistics.mean(per_request)


def compile_ms(compiler, schema: dict) -> tuple[float, float]:
    """(cold, cached) ms from a constraint to its first bitmask, through the engine's compiler."""
    times = []
    for _ in range(2):
        start = time.perf_counter()
        compiled = compiler.compile(StructuredOutputsParams(json=schema)).result()
        compiler.fill_bitmask([compiler.new_matcher(compiled)])
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1]

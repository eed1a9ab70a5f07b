"""TPOT at batch B with every request under a JSON schema against the same batch unconstrained, on the bundled
model, back to back and alternating; and the time to compile the typical schema (5 fields, one nested),
cold and cached, in the engine's own compiler.

Every request writes exactly max_tokens tokens either way: unconstrained ones ignore EOS, constrained ones
follow a schema whose one string needs more characters than max_tokens tokens hold.

Run: .venv/bin/python scripts/bench_structured_tpot.py [--batch 32] [--max-tokens 64] [--rounds 2]"""
from __future__ import annotations

import argparse
import statistics
import time

from qwenserve import LLM, SamplingParams
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


def tpot_ms(llm: LLM, prompts, params: SamplingParams) -> float:
    """Mean over requests of (last token - first token) / (tokens - 1), in ms."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    per_request = []
    for out in outs:
        n = len(out.outputs[0].token_ids)
        assert n == params.max_tokens, (n, out.outputs[0].text[:80])
        per_request.append((out.metrics.finished_time - out.metrics.first_token_time) / (n - 1) * 1e3)
    return statistics.mean(per_request)


def compile_ms(llm: LLM, schema: dict) -> tuple[float, float]:
    """(cold, cached) ms from a constraint to its first bitmask, through the engine's compiler."""
    compiler = llm.engine.structured_output.compiler
    times = []
    for _ in range(2):
        start = time.perf_counter()
        compiled = compiler.compile(StructuredOutputsParams(json=schema)).result()
        compiler.fill_bitmask([compiler.new_matcher(compiled)])
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from qwenserve.model.loader.bundled import bundled_model_path
    llm = LLM(bundled_model_path(), max_num_seqs=max(args.batch, 1))
    tok = llm.get_tokenizer()
    from qwenserve.model.loader.tokenizer import chat_prompt_ids
    topics = ["the sea", "a city", "a robot", "a forest", "the moon", "a violin", "a storm", "a library"]
    prompts = [{"prompt_token_ids": chat_prompt_ids(
        tok, [{"role": "user", "content": f"Write a story about {topics[i % len(topics)]} (#{i}) as JSON."}])}
        for i in range(args.batch)]
    llm.engine.structured_output.compiler.compile(StructuredOutputsParams(json={"type": "object"})).result()
    cold, cached = compile_ms(llm, TYPICAL_SCHEMA)
    print(f"typical schema, constraint to first mask: cold {cold:.1f} ms, cached {cached:.2f} ms "
          "(the vocabulary was built before)")
    for temperature in (0.0, 1.0):
        base = dict(temperature=temperature, seed=0, max_tokens=args.max_tokens)
        plain = SamplingParams(ignore_eos=True, **base)
        constrained = SamplingParams(structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA), **base)
        tpot_ms(llm, prompts[:4], plain)  # warm up
        results = {"unconstrained": [], "json schema": []}
        for _ in range(args.rounds):
            results["unconstrained"].append(tpot_ms(llm, prompts, plain))
            results["json schema"].append(tpot_ms(llm, prompts, constrained))
        u, c = (statistics.median(v) for v in results.values())
        print(f"batch {args.batch}, temperature {temperature}: TPOT unconstrained {u:.1f} ms, json schema {c:.1f} ms "
              f"= {c / u:.3f}x  (rounds: {[round(x, 1) for x in results['unconstrained']]} vs "
              f"{[round(x, 1) for x in results['json schema']]})")


if __name__ == "__main__":
    main()

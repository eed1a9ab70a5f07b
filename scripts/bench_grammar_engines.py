"""Compare grammar engines for structured output on Qwen's vocabulary: llguidance, xgrammar, outlines-core.

For each engine that imports, with the bundled model's tokenizer padded to the model's 151,936 logits:
  - compile: time to turn a typical JSON schema (5 fields, one nested object) into something that masks tokens,
    first (cold) and median of repeats with the engine's own caches bypassed where it has one;
  - mask: time per token to fill the token bitmask for B rows and apply it to a [B, 151936] float32 logits
    tensor, while each row walks its own JSON document token by token (B = 1 and 32).
The apply step is measured twice: with the engine's own function, and with one table-lookup apply in plain
torch (the one qwenserve uses), so fill and apply can be told apart.

Run: .venv/bin/python scripts/bench_grammar_engines.py [--engines llguidance,xgrammar,outlines]
Engines that are not installed are skipped. Nothing here is imported by qwenserve."""
from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import time

import torch

VOCAB = 151936
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
        },
    },
    "required": ["name", "age", "active", "tags", "address"],
}


def documents(n: int, seed: int = 0) -> list[str]:
    """n different JSON instances of SCHEMA, as a model would write them."""
    rng = random.Random(seed)
    words = ["alpha", "river", "stone", "maple", "cedar", "violet", "harbor", "summit", "meadow", "copper"]
    out = []
    for _ in range(n):
        doc = {"name": f"{rng.choice(words).title()} {rng.choice(words).title()}", "age": rng.randint(1, 99),
               "active": rng.random() < 0.5, "tags": rng.sample(words, rng.randint(1, 4)),
               "address": {"street": f"{rng.randint(1, 999)} {rng.choice(words).title()} Street",
                           "city": rng.choice(words).title(), "zip": f"{rng.randint(0, 99999):05d}"}}
        out.append(json.dumps(doc))
    return out


_BYTE_BIASES = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def table_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Add -inf where a token's bit is 0: each mask byte looks up its 8 biases (little-endian bit order)."""
    rows, vocab = logits.shape
    bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), _BYTE_BIASES).view(rows, -1)
    logits.add_(bias[:, :vocab])


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.ll.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def fill(self, matchers, bitmask):
        if len(matchers) == 1:
            self.llt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def apply(self, logits, bitmask):
        self.llt.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask):
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token):
        assert matcher.accept_token(token)


class Outlines:
    name = "outlines-core"

    def __init__(self, tokenizer):
        import outlines_core
        import outlines_core.json_schema
        import outlines_core.kernels.torch
        self.oc, self.kernels = outlines_core, outlines_core.kernels.torch
        # GPT-2's byte -> printable character table (how byte-level BPE spells token bytes), reversed
        to_char = importlib.import_module("transformers.convert_slow_tokenizer").bytes_to_unicode()
        byte_of = {c: b for b, c in to_char.items()}
        special = set(tokenizer.all_special_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for text, token_id in tokenizer.get_vocab().items():
            if token_id in special or any(c not in byte_of for c in text):
                continue
            by_bytes.setdefault(bytes(byte_of[c] for c in text), []).append(token_id)
        self.vocab = outlines_core.Vocabulary(tokenizer.eos_token_id, by_bytes)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matchers, bitmask):
        for i, guide in enumerate(matchers):  # no batch call: one row at a time
            row = bitmask[i:i + 1]
            guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def apply(self, logits, bitmask):
        self.kernels.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token):
        matcher.advance(token, return_tokens=False)


def time_compile(engine, repeats: int) -> tuple[float, float]:
    """(first compile, median of the next `repeats`) in ms; each repeat uses a schema no cache has seen."""
    t = time.perf_counter()
    engine.compile(SCHEMA)
    first = (time.perf_counter() - t) * 1e3
    times = []
    for i in range(repeats):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"]["name"]["description"] = f"variant {i}"  # a new key for any cache
        schema["properties"][f"extra{i}"] = {"type": "string"}  # optional: documents stay valid
        t = time.perf_counter()
        engine.compile(schema)
        times.append((time.perf_counter() - t) * 1e3)
    return first, statistics.median(times)


def time_first_mask(engine) -> float:
    """ms from the schema to the first filled mask (an engine may defer work from compile to there)."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"]["first"] = {"type": "string"}
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    t = time.perf_counter()
    engine.fill([engine.matcher(engine.compile(schema))], bitmask)
    return (time.perf_counter() - t) * 1e3


def time_masks(engine, tokenizer, batch: int, own_apply: bool) -> tuple[float, float, float]:
    """(fill, apply, total) ms per step for `batch` rows, each walking its own document."""
    compiled = engine.compile(SCHEMA)
    docs = [tokenizer.encode(d, add_special_tokens=False) for d in documents(batch)]
    steps = min(len(d) for d in docs)
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    bitmask = torch.full((batch, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(batch, VOCAB)
    apply = engine.apply if own_apply else table_apply
    apply(logits.clone(), bitmask)  # warm up (torch.compile in some engines' apply)
    fill_t = apply_t = 0.0
    for step in range(steps):
        x = logits.clone()
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        t1 = time.perf_counter()
        apply(x, bitmask)
        t2 = time.perf_counter()
        fill_t, apply_t = fill_t + t1 - t0, apply_t + t2 - t1
        for row, m in enumerate(matchers):
            assert x[row, docs[row][step]] != float("-inf"), (engine.name, step, "the document's token is masked")
            engine.accept(m, docs[row][step])
    return fill_t / steps * 1e3, apply_t / steps * 1e3, (fill_t + apply_t) / steps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="llguidance,xgrammar,outlines")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from qwenserve.model.loader.bundled import bundled_model_path
    from qwenserve.model.loader.checkpoint import GGUFCheckpoint
    tokenizer = GGUFCheckpoint(bundled_model_path()).tokenizer()
    kinds = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines": Outlines}
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, vocab {VOCAB}")
    for name in args.engines.split(","):
        try:
            t = time.perf_counter()
            engine = kinds[name](tokenizer)
            setup = (time.perf_counter() - t) * 1e3
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        first, median = time_compile(engine, args.repeats)
        print(f"{engine.name}: tokenizer setup {setup:.0f} ms; compile first {first:.1f} ms, median {median:.1f} ms; "
              f"schema to first mask {time_first_mask(engine):.1f} ms")
        for batch in (1, 32):
            for own in (True, False):
                fill, apply, total = time_masks(engine, tokenizer, batch, own)
                print(f"  batch {batch:2d} apply={'own' if own else 'table'}: fill {fill:.3f} ms + apply "
                      f"{apply:.3f} ms = {total:.3f} ms per step ({total / batch * 1e3:.0f} us per row)")


if __name__ == "__main__":
    main()

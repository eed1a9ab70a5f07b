"""The grammar engine behind structured output: llguidance (chosen by measurement; docs/structured_output.md).

A request's constraint becomes an llguidance grammar and is checked when the request is admitted (a bad schema,
regex or grammar is a RequestError naming the field). Compiling it against the model's vocabulary happens on a
background thread, so a slow grammar never holds up a step; each compiled grammar is cached by the
constraint's key as a matcher at its start, which every sequence under that constraint copies. A matcher
follows its sequence's tokens and fills that sequence's row of a token bitmask: one bit per vocabulary entry,
little-endian within each 32-bit word, 1 = allowed. EOS is allowed only where the grammar accepts, and there
every token that ends a turn is (END_OF_TURN and the model's EOS): a model that ends its answer with the one the
grammar does not know would otherwise be made to write on.

Only this module imports llguidance; the sampler (logits_processors.apply_token_bitmask) reads bitmasks."""
from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections import OrderedDict

import numpy as np

from qwenserve.config.errors import RequestError
from qwenserve.model.loader.tokenizer import END_OF_TURN
from qwenserve.sample.free_prefix import PrefixMasks, blank_tokens_mask, opening_masks
from qwenserve.sample.structured_outputs import FIELD, StructuredOutputsParams

# JSON without free whitespace between tokens: a small model sampled at temperature 1 otherwise can spend its
# whole max_tokens on newlines and never close the object; the separators are those most models write.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'
MAX_ERROR_CHARS = 600  # llguidance's messages can quote a whole grammar back
CACHE_SIZE = 256  # compiled grammars kept (each a few hundred KB at most for typical schemas)


def grammar_text(key: tuple[str, str]) -> str:
    """The llguidance grammar for a constraint, given by its key (not yet checked)."""
    import llguidance
    kind, text = key
    try:
        if kind in ("json", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(text if kind == "json" else ANY_JSON_OBJECT,
                                                                 overrides=JSON_OPTIONS)
        return llguidance.grammar_from(kind, text)  # regex, choice (a JSON list), grammar (Lark or GBNF)
    except ValueError as e:
        raise RequestError(f"{FIELD}.{kind} is invalid: {_short(e)}", param=FIELD) from e


def check_constraint(constraint: StructuredOutputsParams) -> None:
    """Raise RequestError naming the field if the constraint's schema, regex or grammar cannot be compiled.
    Needs no vocabulary: half a millisecond for a typical schema, 40 ms for one of 300 nested objects (llguidance
    releases the GIL meanwhile). The answer is remembered, so the server can check on a thread of its own before
    admission and the engine thread's check at admission is then a lookup."""
    error = _constraint_error(constraint.key)
    if error:
        raise RequestError(error, param=FIELD)


@functools.lru_cache(maxsize=1024)
def _constraint_error(key: tuple[str, str]) -> str:
    """The error message for a constraint's key, or "" when it is valid."""
    import llguidance
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(key))
    except RequestError as e:
        return str(e)
    return f"{FIELD}.{key[0]} is invalid: {_short(messages[0])}" if is_error else ""


def _short(message) -> str:
    text = str(message).strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ..."


def end_of_turn_ids(tokenizer) -> set[int]:
    """The ids of END_OF_TURN's tokens that the vocabulary holds as single special tokens."""
    ids = set()
    for text in END_OF_TURN:
        token_id = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and tokenizer.decode([token_id]) == text:
            ids.add(token_id)
    return ids


class GrammarCompiler:
    """Compiles constraints on one background thread and caches the results by constraint key. The vocabulary
    (llguidance's view of the tokenizer, a few seconds to build) is built there too, on first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int] | set[int]):
        """vocab_size: the model's logits width (the bitmask covers it; ids the tokenizer lacks are never allowed)."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._eos_token_ids = sorted(set(eos_token_ids) | end_of_turn_ids(tokenizer))
        # the tokens the detokenizer leaves out of the text (added tokens marked special)
        self._special_ids = frozenset(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                      if getattr(t, "special", False))
        self._ll_tokenizer = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qwenserve-grammar")
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = None  # llguidance's thread pool for filling many rows at once, made on first use
        self._prefix_masks: dict[str | None, concurrent.futures.Future] = {}  # a free prefix's start -> its masks

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def compile(self, constraint: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the compiled grammar (a matcher at its start, to copy with new_matcher); its exception is
        a RequestError naming the field if the grammar cannot be compiled for this vocabulary."""
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_failed(key, done))
        return future

    def _forget_failed(self, key, future: concurrent.futures.Future) -> None:
        """A failed compile is not kept: the next request with that constraint tries again (and fails again)."""
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, constraint: StructuredOutputsParams):
        import llguidance
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_text(constraint.key), log_level=0)
        if matcher.is_error():
            raise RequestError(f"{FIELD}.{constraint.kind} could not be compiled: {_short(matcher.get_error())}",
                               param=FIELD)
        return matcher

    def _tokenizer(self):
        if self._ll_tokenizer is None:  # only this pool's one thread gets here
            import llguidance.hf
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self._eos_token_ids)
        return self._ll_tokenizer

    def prefix_masks(self, start: str | None) -> concurrent.futures.Future:
        """A future of the PrefixMasks of a free prefix with this start (None: none) over this vocabulary: a scan
        of every token's text, on the compiling thread (the steps go on meanwhile), once per engine for each start."""
        with self._lock:
            future = self._prefix_masks.get(start)
            if future is None:
                future = self._prefix_masks[start] = self._pool.submit(self._scan_prefix_masks, start)
        return future

    def _scan_prefix_masks(self, start: str | None) -> PrefixMasks:
        tokenizer = self._tokenizer()
        texts = [(i, tokenizer.decode_bytes([i]).decode("utf-8", "replace")) for i in range(len(self._hf_tokenizer))]
        opening = opening_masks(texts, start, self.bitmask_words) if start is not None else {}
        return PrefixMasks(opening, blank_tokens_mask(texts, self.bitmask_words))

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes as the grammar sees them (a special token's are its text); only once a grammar has
        been compiled."""
        return self._ll_tokenizer.decode_bytes([token_id])

    def text_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        """A token's bytes as the answer's text holds them: none for a special token where the detokenizer leaves
        those out (the request's skip_special_tokens), so that a free prefix's gate finds its end marker where the
        server's reasoning splitter does."""
        return b"" if skip_special_tokens and token_id in self._special_ids else self.token_bytes(token_id)

    def tokenize_bytes(self, data: bytes) -> list[int]:
        """Tokens of the bytes, for the grammar to take text the model wrote inside another token."""
        return self._ll_tokenizer.tokenize_bytes(data)

    @staticmethod
    def new_matcher(compiled):
        """A matcher of its own for one sequence, at the grammar's start (a copy: microseconds)."""
        return compiled.deep_copy()

    def fill_bitmask(self, matchers: list) -> np.ndarray:
        """The next-token bitmask of each matcher, one row each ([len(matchers), bitmask_words] int32)."""
        import llguidance
        import llguidance.numpy as llnp
        bitmask = np.zeros((len(matchers), self.bitmask_words), dtype=np.int32)  # nothing allowed unless filled
        if len(matchers) == 1:
            llnp.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llnp.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

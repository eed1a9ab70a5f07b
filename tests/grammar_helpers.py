"""Grammars walked by hand on the tiny byte-level tokenizer: which tokens a constraint's mask allows after a
given text. No model: a vocabulary of 320 entries compiles in milliseconds."""
import numpy as np

from qwenserve.entrypoints.openai.tool_calls import tag_token_ids
from qwenserve.sample.grammar import GrammarCompiler
from qwenserve.sample.structured_outputs import StructuredOutputsParams

from helpers import SPECIAL_TOKENS, tiny_tokenizer

VOCAB = 320


class Walker:
    """A GrammarCompiler on the tiny tokenizer, with the tool-call tags as special tokens and only `<|im_end|>`
    as the model's EOS (as the bundled GGUF has it)."""

    def __init__(self):
        self.tokenizer = tiny_tokenizer(VOCAB, SPECIAL_TOKENS + ["<tool_call>", "</tool_call>"])
        self.im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.endoftext = self.tokenizer.convert_tokens_to_ids("<|endoftext|>")
        self.tag_ids = tag_token_ids(self.tokenizer)
        self.compiler = GrammarCompiler(self.tokenizer, VOCAB, {self.im_end})

    def matcher(self, constraint: StructuredOutputsParams):
        return self.compiler.new_matcher(self.compiler.compile(constraint).result(timeout=60))

    def feed(self, matcher, text: str) -> bool:
        """Whether the matcher takes text's tokens (tags and other special tokens as their own tokens)."""
        return all(matcher.consume_token(t) for t in self.tokenizer.encode(text, add_special_tokens=False))

    def allowed(self, matcher) -> set[int]:
        bits = np.unpackbits(self.compiler.fill_bitmask([matcher])[0].view(np.uint8), bitorder="little")
        return set(np.nonzero(bits[:VOCAB])[0].tolist())

    def accepts(self, constraint: StructuredOutputsParams, text: str) -> bool:
        """Whether text is a whole answer the constraint allows: its tokens taken, then an end of turn."""
        matcher = self.matcher(constraint)
        return self.feed(matcher, text) and (matcher.is_stopped() or self.im_end in self.allowed(matcher))

    def close(self):
        self.compiler.shutdown()

"""Incremental detokenization with the bundled model's real tokenizer (byte-level BPE, 151k tokens):
streamed deltas never split a multi-byte character and add up to the full decode."""
import pytest

from qwenserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "def add(a, b):\n    return a + b  # 加法\n",
    "长城是中国古代的军事防御工程，东西绵延上万华里。",
    "Emoji: 🚀🔥👩‍💻 and accents: café, naïve, Ångström.",
    "日本語のテキストと한국어 텍스트, ελληνικά, русский.",
]


@pytest.fixture(scope="module")
def tokenizer():
    from qwenserve.model.loader.bundled import bundled_model_path
    from qwenserve.model.loader.checkpoint import GGUFCheckpoint
    return GGUFCheckpoint(bundled_model_path()).tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_clean_and_complete(tokenizer, text):
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_character_split_over_tokens_is_held_until_complete(tokenizer):
    # a rare 4-byte character the vocabulary has no single token for
    char = next(c for c in ["𠀀", "🦩", "𝔘", "🪐", "𓀀"] if len(tokenizer.encode(c, add_special_tokens=False)) > 1)
    ids = tokenizer.encode(char, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.add(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == char


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    assert "".join(IncrementalDetokenizer(tokenizer, []).add(t) for t in ids) == "hi"
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(kept.add(t) for t in ids) == "hi<|im_end|>"


def test_stop_string_matcher():
    m = StopStringMatcher(["END", "\n\n"])
    assert m.find("abc EN", 4) is None
    assert m.find("abc END more", 6) == (4, "END")  # found across the boundary of the new text
    assert m.find("x\n\ny END", 0) == (1, "\n\n")  # the earliest wins
    assert m.safe_len("abc EN") == 4  # 'EN' may still become 'END': hold it back
    assert StopStringMatcher([]).safe_len("abc") == 3

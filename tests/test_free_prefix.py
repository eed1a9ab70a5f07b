"""A constraint that starts after a free prefix (a thinking model's reasoning): the gate on its own (it finds the
end marker in any cuts and decides where the server's reasoning splitter does), and the engine on a tiny random
model made to write scripted tokens (scripted.py): the tokens before the marker are unconstrained, the grammar
holds after it (a marker of several tokens, in any tokenization, or of one), the answer's first bytes in the
marker's own token are the grammar's, an answer that does not open the prefix is constrained from its first token,
and n > 1, preemption and a prefix that never ends leave no state behind."""
import dataclasses
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwenserve import LLM, SamplingParams
from qwenserve.config.errors import RequestError
from qwenserve.entrypoints.openai.reasoning import ReasoningSplitter, constraint_prefix
from qwenserve.sample.free_prefix import (CONSTRAINED, FREE, LEADING_BLANKS, MAX_LEADING_BLANK_TOKENS, UNDECIDED,
                                          PrefixGate, opening_masks)
from qwenserve.sample.structured_outputs import BLANKS, FreePrefix, StructuredOutputsParams as Constraint

from helpers import SPECIAL_TOKENS, record_preemptions, save_hf_dir, tiny_hf_model, tiny_tokenizer, tiny_vocab
from scripted import scripted

OPENED = FreePrefix(end="</think>")  # the prompt opened the free text
MAY_OPEN = FreePrefix(end="</think>", start="<think>")
DIGITS = "[0-9]{4}"

THINKING_ON = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---- the gate ----------------------------------------------------------------------------------------------

def test_free_prefix_shape_errors_and_the_key_ignores_it():
    with pytest.raises(RequestError, match="free prefix needs end as a non-empty string"):
        FreePrefix(end="")
    with pytest.raises(RequestError, match="free prefix must be a FreePrefix"):
        Constraint(regex="a", free_prefix="</think>")
    assert Constraint(regex="a", free_prefix=OPENED).key == Constraint(regex="a").key
    with pytest.raises(RequestError, match="unknown field"):  # a request body cannot set it
        Constraint.from_dict({"regex": "a", "free_prefix": "</think>"})


def test_constraint_prefix_follows_the_prompt():
    assert constraint_prefix("qwen3", THINKING_ON + "<think>\n") == OPENED
    assert constraint_prefix("qwen3", THINKING_ON) == MAY_OPEN
    assert constraint_prefix("qwen3", THINKING_ON + "<think>\n\n</think>\n\n") is None  # thinking off
    asked = THINKING_ON.replace("hi", "what does <think> do?")  # the user's tag is text: the answer may open one
    assert constraint_prefix("qwen3", asked) == MAY_OPEN
    # continue_final_message: the final assistant message decides where the answer goes on
    assert constraint_prefix("qwen3", THINKING_ON + "<think>\nLet me") == OPENED
    assert constraint_prefix("qwen3", THINKING_ON + "<think>\nplan</think>\n\n") is None
    assert constraint_prefix("qwen3", THINKING_ON + "The answer is") is None
    assert constraint_prefix("qwen3", THINKING_ON + "\n") == MAY_OPEN


def gate_run(prefix: FreePrefix, pieces: list[bytes]):
    """(the phase at the end, the bytes the grammar takes as the answer or None, whether the free text opened)."""
    gate, answer, opened, fed = PrefixGate(prefix), None, False, b""
    for piece in pieces:
        fed += piece
        if gate.phase == LEADING_BLANKS and gate.take_blank(piece):
            continue  # the answer's leading blanks: not the grammar's
        if gate.phase in (LEADING_BLANKS, CONSTRAINED):
            answer += piece
            continue
        now_opened, tail = gate.feed(piece)
        opened |= now_opened
        if tail is not None:
            answer = tail
        elif gate.phase == CONSTRAINED:  # decided as the answer: the grammar has taken it from its start
            answer = fed
    return gate.phase, answer, opened


PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "{", "</thi",
                                   "nk>", "<th", "é", "\x1c", ">\n"]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(pieces=PIECES, cuts=st.lists(st.integers(0, 80), max_size=8),
       prompt=st.sampled_from([THINKING_ON, THINKING_ON + "<think>\n", THINKING_ON + "<think>\nLet me"]))
def test_the_gate_splits_where_the_reasoning_splitter_does(pieces, cuts, prompt):
    """Fed the answer's bytes in any cuts (a character or a tag cut in two included), the constraint starts where
    the splitter's content starts: after the reasoning, or at the answer's start if it has none; blanks that come
    in the free text's last token, after its end, are not the grammar's."""
    answer = "".join(pieces).encode()
    bounds = sorted({min(c, len(answer)) for c in cuts} | {0, len(answer)})
    phase, taken, opened = gate_run(constraint_prefix("qwen3", prompt),
                                     [answer[a:b] for a, b in zip(bounds, bounds[1:])])
    reasoning, content = ReasoningSplitter("qwen3", prompt).split_whole(answer.decode())
    if reasoning is None:  # no reasoning: the grammar takes the answer from its first token (undecided: may yet)
        assert not opened and (phase == UNDECIDED or taken.decode() == content)
    elif taken is None:  # cut short inside the reasoning
        assert phase in (FREE, UNDECIDED) and not content
    else:
        tail = taken.decode()
        assert phase == CONSTRAINED and content.endswith(tail)
        assert not content[:len(content) - len(tail)].strip(BLANKS)


def test_opening_masks_allow_exactly_what_keeps_the_start_possible():
    texts = {0: " ", 1: "<", 2: "<think>", 3: " <th", 4: "ink>x", 5: "{", 6: "", 7: "i", 8: "<t>", 9: "\n<think>ab",
             10: "\x1c<think>", 11: "\n\n"}
    masks = opening_masks(texts.items(), "<think>", 1)

    def allowed(lead):
        return {i for i in texts if masks[lead][0] >> i & 1}
    assert set(masks) == {"", "<", "<t", "<th", "<thi", "<thin", "<think"}
    # blank tokens open nothing (the grammar alone may allow them); a control character is not blank
    assert allowed("") == {1, 2, 3, 9}
    assert allowed("<th") == {4, 7}
    assert allowed("<think") == set()  # ">" alone is not in this vocabulary


# ---- the engine, on a tiny model made to write scripted tokens --------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_hf_dir(tiny_hf_model(seed=71, max_position_embeddings=512), str(tmp_path_factory.mktemp("fp")))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="float32", kv_cache_memory="8MiB")


def ids(llm, text: str) -> list[int]:
    return llm.engine.tokenizer.encode(text, add_special_tokens=False)


def run(llm, prompt="hi", **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs


def assert_no_leak(llm):
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv.check_invariants([])
    manager = llm.engine.structured_output
    assert manager.num_compiling == 0 and not manager._matchers and not manager._gates and not manager._masks


def test_the_free_text_is_unconstrained_and_the_grammar_holds_after_its_end(llm):
    reasoning = "ab {x</think>"  # letters, a space, a brace: all forbidden by the grammar
    with scripted(ids(llm, reasoning)):
        out = run(llm, temperature=0.0, max_tokens=30, structured_outputs=Constraint(regex=DIGITS,
                                                                                     free_prefix=OPENED))[0]
        # the same script under the plain constraint: the mask wins from the first token (the test can fail)
        plain = run(llm, temperature=0.0, max_tokens=30, structured_outputs=Constraint(regex=DIGITS))[0]
    assert out.text.startswith(reasoning) and re.fullmatch(DIGITS, out.text[len(reasoning):]), out.text
    assert out.finish_reason == "stop"
    assert re.fullmatch(DIGITS, plain.text)
    assert_no_leak(llm)


def test_a_marker_of_several_tokens_is_found_however_it_is_tokenized(llm):
    merged, split = ids(llm, "</think>"), [ord(c) for c in "</think>"]  # "in" is one token, or two
    assert merged != split and len(merged) > 1
    for marker in (merged, split):
        with scripted(ids(llm, "x") + marker):
            out = run(llm, temperature=1.0, seed=3, max_tokens=30,
                      structured_outputs=Constraint(regex=DIGITS, free_prefix=OPENED))[0]
        assert out.token_ids[:len(marker) + 1] == ids(llm, "x") + marker
        assert re.fullmatch(DIGITS, out.text[len("x</think>"):]), out.text
    assert_no_leak(llm)


def test_the_answers_first_bytes_in_the_markers_own_token_are_the_grammars(llm):
    """"# the" is two tokens, "#" and " the": with "# t" as the marker, "he" starts the answer inside a token."""
    script = ids(llm, "# the")
    assert len(script) == 2
    with scripted(script):
        out = run(llm, temperature=0.0, max_tokens=20,
                  structured_outputs=Constraint(regex="he[0-9]{2}", free_prefix=FreePrefix(end="# t")))[0]
        assert re.fullmatch("# the[0-9]{2}", out.text), out.text
        with pytest.raises(RuntimeError, match="structured_outputs: the output could not be kept to the grammar"):
            run(llm, temperature=0.0, max_tokens=20,
                structured_outputs=Constraint(regex="[0-9]{2}", free_prefix=FreePrefix(end="# t")))
    assert_no_leak(llm)


def test_an_answer_may_open_its_free_text_or_be_constrained_from_its_first_token(llm):
    constraint = Constraint(regex=DIGITS, free_prefix=MAY_OPEN)
    with scripted(ids(llm, "<think>q</think>")):  # the start tag: only the opening allows it
        opened = run(llm, temperature=0.0, max_tokens=40, structured_outputs=constraint)[0]
    assert opened.text.startswith("<think>q</think>") and re.fullmatch(DIGITS, opened.text[len("<think>q</think>"):])
    with scripted(ids(llm, "7")):  # the answer itself: the grammar from the first token on
        answer = run(llm, temperature=1.0, seed=2, max_tokens=40, structured_outputs=constraint)[0]
    assert re.fullmatch(DIGITS, answer.text) and answer.text[0] == "7"
    with scripted(ids(llm, "<th") + ids(llm, "7")):  # past "<th" only the start tag can follow
        cut = run(llm, temperature=1.0, seed=2, max_tokens=12, structured_outputs=constraint)[0]
    assert cut.text.startswith("<think>"), cut.text
    assert_no_leak(llm)


def test_a_blank_first_token_is_the_grammars_alone(llm):
    """Undecided, a blank (or a control character str.isspace takes) that the grammar refuses is masked like any
    other token the grammar refuses: it would open nothing, and an output left to blanks writes them until
    max_tokens. The answer is the grammar's, as without a free prefix."""
    constraint = Constraint(regex=DIGITS, free_prefix=MAY_OPEN)
    for first in (" ", "\n", "\x1c"):
        with scripted(ids(llm, first)):
            out = run(llm, temperature=0.0, max_tokens=12, structured_outputs=constraint)[0]
        assert re.fullmatch(DIGITS, out.text) and out.finish_reason == "stop", (first, out.text)
    # a grammar that takes blanks keeps them, and the output may still open its free text after them
    with scripted(ids(llm, "\n<think>q</think>")):
        out = run(llm, temperature=0.0, max_tokens=20,
                  structured_outputs=Constraint(regex="\\s*[0-9]{4}", free_prefix=MAY_OPEN))[0]
    assert out.text.startswith("\n<think>q</think>") and re.fullmatch(DIGITS, out.text[len("\n<think>q</think>"):])
    assert_no_leak(llm)


def test_blanks_after_the_marker_in_its_own_token_are_not_the_grammars(tmp_path):
    """The free text is unmasked, so its last token may end the marker and carry a newline (Qwen's vocabulary has
    `>\\n`), which a grammar with no free whitespace refuses: the grammar starts after the blanks, and the
    request goes on."""
    from qwenserve.model.loader.tokenizer import tokenizer_from_gguf
    path = save_hf_dir(tiny_hf_model(seed=71, max_position_embeddings=512), str(tmp_path))
    tokens, types, merges = tiny_vocab(320)
    pad = tokens.index("[PAD0]")
    tokens[pad], types[pad] = ">\u010a", 1  # ">\\n" in the byte-level alphabet
    tokenizer_from_gguf({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges + ["> \u010a"],
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
    }).save_pretrained(path)
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB")
    script = ids(llm, "plan</think>\n")
    assert llm.engine.tokenizer.decode(script[-1:]) == ">\n"
    with scripted(script):
        out = run(llm, temperature=0.0, max_tokens=20,
                  structured_outputs=Constraint(regex=DIGITS, free_prefix=OPENED))[0]
    assert out.token_ids[:len(script)] == script and re.fullmatch(DIGITS, out.text[len("plan</think>\n"):]), out.text
    assert_no_leak(llm)
    llm.engine.shutdown()


def test_a_json_answer_may_start_with_blank_tokens_after_the_marker(llm):
    """With answer_blanks (a JSON answer or a tool call after Qwen3's reasoning), the blank-only tokens that
    follow the marker (Qwen3 writes `</think>` then `\n\n`) are allowed beside the grammar's and not fed to it, at
    most MAX_LEADING_BLANK_TOKENS of them; without it (a regex, a choice) the grammar masks them."""
    blanks = FreePrefix(end="</think>", answer_blanks=True)
    schema = Constraint(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                              "additionalProperties": False})
    script = ids(llm, "ok</think>") + ids(llm, "\n") + ids(llm, " ") + ids(llm, '{"a": 5}')
    with scripted(script):
        out = run(llm, temperature=0.0, max_tokens=30,
                  structured_outputs=dataclasses.replace(schema, free_prefix=blanks))[0]
    assert out.token_ids[:len(script)] == script and json.loads(out.text[len("ok</think>"):]) == {"a": 5}, out.text
    # past the bound the grammar alone decides: a third blank is masked
    script = ids(llm, "ok</think>") + ids(llm, "\n") * (MAX_LEADING_BLANK_TOKENS + 2) + ids(llm, '{"a": 5}')
    with scripted(script):
        out = run(llm, temperature=0.0, max_tokens=30,
                  structured_outputs=dataclasses.replace(schema, free_prefix=blanks))[0]
    tail = out.text[len("ok</think>"):]
    assert tail.startswith("\n" * MAX_LEADING_BLANK_TOKENS) and tail[MAX_LEADING_BLANK_TOKENS] == "{", out.text
    with scripted(ids(llm, "ok</think>") + ids(llm, "\n") + ids(llm, "1234")):  # a regex stays exact
        out = run(llm, temperature=0.0, max_tokens=20,
                  structured_outputs=Constraint(regex=DIGITS, free_prefix=OPENED))[0]
    assert re.fullmatch(DIGITS, out.text[len("ok</think>"):]), out.text
    assert_no_leak(llm)


def test_sampled_answers_take_at_most_the_bound_of_leading_blanks(llm):
    """n=4 samples at temperature 1 after a scripted marker, under a short schema: each answer is JSON of the schema
    after at most MAX_LEADING_BLANK_TOKENS blank-only tokens, whatever the model samples."""
    schema = Constraint(json={"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
                              "additionalProperties": False},
                        free_prefix=FreePrefix(end="</think>", answer_blanks=True))
    script = ids(llm, "ok</think>")
    with scripted(script):
        outs = run(llm, n=4, temperature=1.0, seed=11, max_tokens=40, structured_outputs=schema)
    tokenizer = llm.engine.tokenizer
    for out in outs:
        assert out.token_ids[:len(script)] == script and out.finish_reason == "stop", out.text
        answer = out.token_ids[len(script):]
        blanks = next(i for i, t in enumerate(answer) if tokenizer.decode([t]).strip(BLANKS))
        assert blanks <= MAX_LEADING_BLANK_TOKENS, out.text
        assert json.loads(out.text[len("ok</think>"):])["a"] in (1, 2, 3), out.text
    assert_no_leak(llm)


def test_a_special_token_inside_the_marker_is_no_text_to_the_gate(llm):
    """The reasoning splitter reads the detokenized text, which leaves special tokens out: `</` + <|endoftext|> +
    `think>` is the marker to it, so the gate finds it there too and the grammar holds after it."""
    special = llm.engine.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    script = ids(llm, "x</") + [special] + ids(llm, "think>")
    with scripted(script):
        out = run(llm, temperature=0.0, max_tokens=20,
                  structured_outputs=Constraint(regex=DIGITS, free_prefix=OPENED))[0]
    assert out.token_ids[:len(script)] == script and out.text.startswith("x</think>"), out.text
    assert re.fullmatch(DIGITS, out.text[len("x</think>"):]), out.text
    assert_no_leak(llm)


def test_the_gate_takes_a_bounded_run_of_leading_blanks():
    gate = PrefixGate(FreePrefix(end="</think>", answer_blanks=True))
    assert gate.feed(b"x</think>") == (False, b"") and gate.phase == LEADING_BLANKS
    assert gate.take_blank(b"\n\n") and gate.phase == LEADING_BLANKS
    assert not gate.take_blank(b"{") and gate.phase == CONSTRAINED  # the answer's first text
    gate = PrefixGate(FreePrefix(end="</think>", answer_blanks=True))
    gate.feed(b"x</think>")
    assert all(gate.take_blank(b" ") for _ in range(MAX_LEADING_BLANK_TOKENS)) and gate.phase == CONSTRAINED
    gate = PrefixGate(FreePrefix(end="</think>", answer_blanks=True))
    assert gate.feed(b"x</think> {") == (False, b"{") and gate.phase == CONSTRAINED  # the answer began in it
    gate = PrefixGate(OPENED)
    assert gate.feed(b"x</think>") == (False, b"") and gate.phase == CONSTRAINED


def test_free_text_that_never_ends_is_never_masked(llm):
    sent = []
    submit = llm.engine.executor.submit

    def spy(scheduler_output):
        sent.append(scheduler_output.grammar_bitmask)
        return submit(scheduler_output)
    llm.engine.executor.submit = spy
    try:
        out = run(llm, temperature=1.0, seed=4, max_tokens=12, ignore_eos=True,
                  structured_outputs=Constraint(regex=DIGITS, free_prefix=OPENED))[0]
    finally:
        del llm.engine.executor.submit
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert sent and all(mask is None for mask in sent)
    assert_no_leak(llm)


def test_n_samples_each_wait_out_their_own_free_text(llm):
    script = ids(llm, "ok</think>")
    with scripted(script):
        outs = run(llm, n=4, temperature=1.0, seed=5, max_tokens=30,
                   structured_outputs=Constraint(regex=DIGITS, free_prefix=OPENED))
    tails = [o.text[len("ok</think>"):] for o in outs]
    assert all(o.token_ids[:len(script)] == script for o in outs)
    assert all(re.fullmatch(DIGITS, t) for t in tails) and len(set(tails)) > 1
    # undecided, each sample either opens its free text or is the answer (the grammar's from its first token)
    mixed = run(llm, n=6, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True,
                structured_outputs=Constraint(regex=DIGITS, free_prefix=MAY_OPEN))
    for o in mixed:  # never blanks alone: a blank token opens nothing, and the grammar refuses it
        assert re.fullmatch(DIGITS, o.text) or o.text.startswith("<think>") or (
            o.text and "<think>".startswith(o.text)), o.text
    assert_no_leak(llm)


def test_preemption_keeps_the_gate_and_the_matcher(tiny, llm):
    regex = "[a-z ]{20,40}"
    script = ids(llm, "think it through</think>")
    ps = [{"prompt_token_ids": list(range(10 + i, 70 + i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=70,
                            structured_outputs=Constraint(regex=regex, free_prefix=OPENED))
    with scripted(script):
        ample = [o.outputs[0].text for o in llm.generate(ps, params, use_tqdm=False)]
        tight = LLM(tiny, dtype="float32", kv_cache_memory=96 * 1024)  # 192 tokens: six requests need ~1000
        preempted = record_preemptions(tight)
        assert [o.outputs[0].text for o in tight.generate(ps, params, use_tqdm=False)] == ample
    assert preempted, "the test did not exercise preemption"
    head = "think it through</think>"
    assert all(text.startswith(head) and re.fullmatch(regex, text[len(head):]) for text in ample), ample
    assert_no_leak(tight)


def test_a_marker_that_is_one_token(tmp_path):
    """Qwen3's vocabulary has `<think>` and `</think>` as tokens of their own."""
    path = save_hf_dir(tiny_hf_model(seed=71, max_position_embeddings=512), str(tmp_path))
    tiny_tokenizer(320, SPECIAL_TOKENS + ["<think>", "</think>"]).save_pretrained(path)
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB")
    end, start = ids(llm, "</think>"), ids(llm, "<think>")
    assert len(end) == 1 and len(start) == 1
    with scripted(start + ids(llm, "{ ") + end):
        out = run(llm, temperature=0.0, max_tokens=30, skip_special_tokens=False,
                  structured_outputs=Constraint(regex=DIGITS, free_prefix=MAY_OPEN))[0]
    assert out.token_ids[:4] == start + ids(llm, "{ ") + end
    assert re.fullmatch(DIGITS, llm.engine.tokenizer.decode(out.token_ids[4:], skip_special_tokens=True)), out.text
    assert_no_leak(llm)
    llm.engine.shutdown()

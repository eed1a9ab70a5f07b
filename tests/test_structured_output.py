"""Structured output on a tiny random model (float32) and on the pieces it is made of: constraints are checked
at admission with errors that name the field, the token bitmask masks exactly the forbidden tokens of the
constrained rows, the model's output always matches its constraint (greedy or sampled, after preemption, with
n > 1), its unconstrained neighbours are unaffected, and a grammar that cannot compile fails its request."""
import json
import re
import threading
import time

import numpy as np
import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.config.errors import RequestError
from qwenserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from qwenserve.sample import grammar as grammar_module
from qwenserve.sample.grammar import check_constraint
from qwenserve.sample.logits_processors import apply_token_bitmask
from qwenserve.sample.sampler import Sampler
from qwenserve.sample.structured_outputs import StructuredOutputsParams as Constraint

from grammar_helpers import Walker
from helpers import record_preemptions, save_hf_dir, tiny_hf_model

SCHEMA = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                         "b": {"type": "string", "maxLength": 6}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_hf_dir(tiny_hf_model(seed=71, max_position_embeddings=512), str(tmp_path_factory.mktemp("so")))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="float32", kv_cache_memory="8MiB")


def generate(llm, prompts, **params):
    if isinstance(prompts, str):
        prompts = [prompts]
    return [o.outputs for o in llm.generate(prompts, SamplingParams(**params), use_tqdm=False)]


def assert_no_leak(llm):
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv.check_invariants([])
    assert llm.engine.structured_output.num_compiling == 0 and not llm.engine.structured_output._matchers


# ---- the constraint's shape and its check at admission ------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "choice must be a non-empty list of non-empty strings"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"json": "{not json"}, "json is not valid JSON"),
    ({"json": "[1, 2]"}, "json must be a JSON object"),
    ({"json": 3}, "json must be a JSON schema"),
])
def test_constraint_shape_errors_name_the_field(fields, message):
    with pytest.raises(RequestError, match=re.escape(message)) as e:
        Constraint(**fields)
    assert e.value.param == "structured_outputs"


def test_unknown_constraint_field_is_an_error_not_dropped():
    with pytest.raises(RequestError, match="unknown field.*guided_json"):
        SamplingParams(structured_outputs={"guided_json": SCHEMA})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == Constraint(regex="a+")


def test_a_schema_as_an_object_or_as_text_shares_a_key_and_its_key_order_is_kept():
    assert Constraint(json=SCHEMA).key == Constraint(json=json.dumps(SCHEMA, indent=4)).key
    assert Constraint(json=SCHEMA).key != Constraint(json={"type": "object"}).key
    swapped = SCHEMA | {"properties": {"b": SCHEMA["properties"]["b"], "a": SCHEMA["properties"]["a"]}}
    assert Constraint(json=swapped).key != Constraint(json=SCHEMA).key  # another grammar: b is written first


@pytest.mark.parametrize("field, value", [("guided_json", SCHEMA), ("guided_regex", "a+"), ("guided_choice", ["x", "y"]),
                                          ("guided_grammar", 'start: "x"')])
def test_vllms_guided_fields_are_constraints_too(field, value):
    kind = field.removeprefix("guided_")
    for body in (ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **{field: value}),
                 CompletionRequest(prompt="hi", **{field: value})):
        assert body.sampling_params({}).structured_outputs == Constraint(**{kind: value})
        assert body.constraint_field == field


@pytest.mark.parametrize("fields, param, message", [
    ({"guided_regex": ""}, "guided_regex", "guided_regex must be a non-empty string"),
    ({"guided_json": "[1]"}, "guided_json", "guided_json must be a JSON object"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "give guided_regex or guided_choice, not both"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "structured_outputs", "not both"),
])
def test_guided_field_errors_name_the_field(fields, param, message):
    with pytest.raises(RequestError, match=re.escape(message)) as e:
        CompletionRequest(prompt="hi", **fields).sampling_params({})
    assert e.value.param == param


@pytest.mark.parametrize("fields, message", [
    ({"regex": "[0-9"}, "(?s)structured_outputs.regex is invalid: .*unclosed character class"),
    ({"json": {"type": "foo"}}, "structured_outputs.json is invalid: .*foo"),
    ({"grammar": "start: missing_rule"}, "structured_outputs.grammar is invalid: .*missing_rule"),
])
def test_invalid_schema_regex_grammar_fail_at_admission(llm, fields, message):
    with pytest.raises(RequestError, match=message) as e:
        check_constraint(Constraint(**fields))
    assert e.value.param == "structured_outputs"
    with pytest.raises(ValueError, match=message):
        generate(llm, "hi", structured_outputs=Constraint(**fields))
    assert_no_leak(llm)


# ---- the grammar: what the request wrote, and where the answer may end ----------------------------------------

@pytest.fixture(scope="module")
def walker():
    walker = Walker()
    yield walker
    walker.close()


def test_json_keys_come_in_the_schemas_order_not_sorted(walker):
    schema = {"type": "object", "additionalProperties": False, "required": ["title", "year", "authors"],
              "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                             "authors": {"type": "array", "items": {"type": "string"}}}}
    for given in (schema, json.dumps(schema)):
        assert walker.accepts(Constraint(json=given), '{"title": "Dune", "year": 1965, "authors": ["F. Herbert"]}')
        assert not walker.accepts(Constraint(json=given), '{"authors": ["F. Herbert"], "title": "Dune", "year": 1965}')


@pytest.mark.parametrize("fields, partial, complete", [
    ({"regex": "[0-9]+"}, "", "12"),
    ({"choice": ["ab", "abc"]}, "a", "ab"),
    ({"grammar": 'start: "x"+'}, "", "xx"),
    ({"grammar": 'root ::= "y" "y"*'}, "", "yy"),
    ({"json": {"type": "array", "items": {"type": "integer"}}}, "[1", "[1, 2]"),
    ({"json_object": True}, '{"a"', '{"a": 1}'),
])
def test_a_complete_grammar_lets_the_answer_end_with_every_end_of_turn_token(walker, fields, partial, complete):
    """The model's EOS here is <|im_end|> only; <|endoftext|> ends a turn too, and a model that chose it where
    the grammar is complete would otherwise be made to write on."""
    ends = {walker.im_end, walker.endoftext}
    matcher = walker.matcher(Constraint(**fields))
    assert walker.feed(matcher, partial) and not ends & walker.allowed(matcher)
    matcher = walker.matcher(Constraint(**fields))
    assert walker.feed(matcher, complete) and ends <= walker.allowed(matcher)
    assert matcher.consume_token(walker.endoftext) and matcher.is_stopped()


# ---- the mask ----------------------------------------------------------------------------------------------

def reference_mask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    """Bit by bit: token t of row rows[i] stays iff bit t % 32 of word t // 32 of bitmask[i] is set."""
    out = logits.clone()
    for i, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [[0, 1, 2], [1], [2, 0]])
def test_bitmask_masks_exactly_the_forbidden_tokens_of_its_rows(rows):
    vocab = 70  # not a multiple of 32: the last word's spare bits are ignored
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), 3), dtype=torch.int32, generator=g).numpy()
    expected = reference_mask(logits, rows, bitmask)
    apply_token_bitmask(logits, torch.tensor(rows), torch.from_numpy(bitmask))
    assert torch.equal(logits, expected)


def test_a_wider_bitmask_ignores_bits_past_the_logits_and_a_narrower_one_is_refused():
    logits = torch.zeros(1, 40)
    apply_token_bitmask(logits, torch.tensor([0]), torch.tensor([[-1, 0, -1]], dtype=torch.int32))
    assert torch.isinf(logits[0, 32:]).all() and not torch.isinf(logits[0, :32]).any()
    with pytest.raises(ValueError, match="needs 3 int32 words a row"):
        apply_token_bitmask(torch.zeros(1, 70), torch.tensor([0]), torch.zeros(1, 2, dtype=torch.int32))


class Row:
    def __init__(self, temperature=0.0, min_tokens=0, eos=()):
        self.params = SamplingParams(temperature=temperature, min_tokens=min_tokens, max_tokens=8)
        self.params.eos_token_ids = frozenset(eos)
        self.generator = torch.Generator().manual_seed(1)
        self.token_ids, self.num_prompt_tokens = [1, 2], 2

    @property
    def num_output_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens


def bitmask_allowing(vocab: int, allowed: list[list[int]]) -> torch.Tensor:
    bits = np.zeros((len(allowed), (vocab + 31) // 32 * 32), dtype=np.uint8)
    for i, tokens in enumerate(allowed):
        bits[i, tokens] = 1
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())


def test_sampler_picks_only_allowed_tokens_and_leaves_other_rows_alone():
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    rows = [Row(), Row(), Row(temperature=1.0), Row(temperature=1.0)]
    allowed = [[7, 9], [11, 30, 31, 32]]
    grammar = (torch.tensor([1, 3]), bitmask_allowing(vocab, allowed))
    unconstrained = Sampler("cpu")(logits, rows[:1]).token_ids[0]
    before = logits.clone()
    for _ in range(20):
        tokens = Sampler("cpu")(logits, rows, grammar).token_ids
        assert tokens[0] == unconstrained
        assert tokens[1] == max(allowed[0], key=lambda t: logits[1, t])
        assert tokens[3] in allowed[1]
    assert torch.equal(logits, before), "the caller's logits were written"


def test_grammar_wins_over_min_tokens_when_it_allows_only_a_stop_token():
    vocab, eos = 40, 5
    logits = torch.randn(1, vocab)
    grammar = (torch.tensor([0]), bitmask_allowing(vocab, [[eos]]))
    assert Sampler("cpu")(logits, [Row(min_tokens=4, eos=[eos])], grammar).token_ids == [eos]


# ---- the engine ----------------------------------------------------------------------------------------------

def test_outputs_match_regex_choice_json_and_grammar(llm):
    regex, choices = r"[a-e]{2,5}-[0-9]{3}", ["apple", "banana split", "cherry"]
    for temperature in (0.0, 1.0):
        params = dict(max_tokens=40, temperature=temperature, seed=3)
        for out in generate(llm, ["the", "a b c"], structured_outputs=Constraint(regex=regex), **params):
            assert re.fullmatch(regex, out[0].text) and out[0].finish_reason == "stop"
        for out in generate(llm, ["x", "y z"], structured_outputs=Constraint(choice=choices), **params):
            assert out[0].text in choices and out[0].finish_reason == "stop"
        for out in generate(llm, ["hi"], structured_outputs=Constraint(json=SCHEMA), **params):
            assert out[0].finish_reason == "stop", out[0].text
            value = json.loads(out[0].text)
            assert set(value) == {"a", "b"} and isinstance(value["a"], int) and len(value["b"]) <= 6
        for out in generate(llm, ["hi"], structured_outputs=Constraint(grammar='start: "yes" | "no" | "maybe"'),
                            **params):
            assert out[0].text in ("yes", "no", "maybe")
        gbnf = Constraint(grammar='root ::= [0-9] "+" [0-9]')  # GBNF, as llama.cpp writes it
        for out in generate(llm, ["hi"], structured_outputs=gbnf, **params):
            assert re.fullmatch(r"[0-9]\+[0-9]", out[0].text)
    assert_no_leak(llm)


def test_json_object_is_any_json_object(llm):
    out = generate(llm, "hi", structured_outputs=Constraint(json_object=True), max_tokens=60, temperature=0.0)[0][0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # a random model may write a long object; what it wrote is a JSON object's start
        assert out.text.startswith("{")


def test_n_samples_each_follow_the_grammar(llm):
    outs = generate(llm, "hi", n=4, temperature=1.0, seed=5, max_tokens=20,
                    structured_outputs=Constraint(regex="[0-9]{4}"))
    assert len(outs[0]) == 4 and all(re.fullmatch("[0-9]{4}", c.text) for c in outs[0])
    assert len({c.text for c in outs[0]}) > 1


class Untouchable:
    """A step's batch that fails the test if anything reads it."""
    def __getattr__(self, name):
        raise AssertionError(f"the unconstrained batch was walked ({name})")


def test_no_live_constraint_means_the_batch_is_never_walked(llm):
    manager = llm.engine.structured_output
    assert not manager._matchers
    manager.attach_bitmask(Untouchable())
    assert manager.advance(Untouchable()) == (set(), {})
    manager.release(Untouchable())


def test_unconstrained_neighbour_gives_the_same_greedy_output(llm):
    plain = {"prompt_token_ids": list(range(20, 45))}
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate([plain], greedy, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=24,
                                 structured_outputs=Constraint(regex="[a-z]{20}"))
    together = llm.generate([plain, "the cat", plain], [greedy, constrained, greedy], use_tqdm=False)
    assert together[0].outputs[0].token_ids == alone == together[2].outputs[0].token_ids
    assert re.fullmatch("[a-z]{20}", together[1].outputs[0].text)


def test_preemption_keeps_constrained_output_and_matcher_state(tiny, llm):
    regex = "[a-z ]{30,60}"
    ps = [{"prompt_token_ids": list(range(10 + i, 70 + i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=70, structured_outputs=Constraint(regex=regex))
    ample = [o.outputs[0].text for o in llm.generate(ps, params, use_tqdm=False)]
    tight = LLM(tiny, dtype="float32", kv_cache_memory=96 * 1024)  # 192 tokens: six requests need ~800
    preempted = record_preemptions(tight)
    assert [o.outputs[0].text for o in tight.generate(ps, params, use_tqdm=False)] == ample
    assert preempted, "the test did not exercise preemption"
    assert all(re.fullmatch(regex, text) for text in ample)
    assert_no_leak(tight)


def test_a_grammar_that_fails_to_compile_fails_its_request_never_unconstrained(llm, monkeypatch):
    """A constraint can pass the check at admission and still fail against the vocabulary (the grammar engine's
    limits): the request then fails with an error naming the field; its neighbours finish."""
    def refuse(self, constraint):
        raise RequestError("structured_outputs.regex could not be compiled: too complex", param="structured_outputs")
    monkeypatch.setattr(grammar_module.GrammarCompiler, "_compile", refuse)
    with pytest.raises(RuntimeError, match="structured_outputs.regex could not be compiled"):
        generate(llm, "hi", max_tokens=5, structured_outputs=Constraint(regex="[0-9]{7}"))
    assert_no_leak(llm)


def test_a_slow_compile_does_not_stall_other_requests(llm, monkeypatch):
    """While one request's grammar compiles (held here for as long as the test needs), another runs to its end."""
    release = threading.Event()
    compile_grammar = grammar_module.GrammarCompiler._compile

    def slow(self, constraint):
        release.wait(30)
        return compile_grammar(self, constraint)
    monkeypatch.setattr(grammar_module.GrammarCompiler, "_compile", slow)
    engine = llm.engine
    engine.add_request("slow", "hi", SamplingParams(max_tokens=4, structured_outputs=Constraint(regex="[0-9]{3}")))
    engine.add_request("plain", "hi", SamplingParams(max_tokens=8, ignore_eos=True))
    finished = {}
    start = time.time()
    while "plain" not in finished and time.time() - start < 30:
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "plain" in finished and "slow" not in finished and engine.structured_output.num_compiling == 1
    release.set()
    while "slow" not in finished and time.time() - start < 60:
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert re.fullmatch("[0-9]{3}", finished["slow"].outputs[0].text)
    assert_no_leak(llm)


def test_abort_while_compiling_leaves_nothing_behind(llm, monkeypatch):
    release = threading.Event()
    compile_grammar = grammar_module.GrammarCompiler._compile
    monkeypatch.setattr(grammar_module.GrammarCompiler, "_compile",
                        lambda self, c: release.wait(30) and compile_grammar(self, c))
    llm.engine.add_request("gone", "hi", SamplingParams(structured_outputs=Constraint(regex="[0-9]{5}")))
    assert llm.engine.structured_output.num_compiling == 1
    llm.engine.abort_request("gone")
    release.set()
    assert_no_leak(llm)


@pytest.mark.multiproc
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_worker_processes_apply_the_same_masks(parallel_tiny, tp, pp):
    """The engine's matchers fill the masks and every worker process applies them: tensor-parallel ranks and
    pipeline stages with steps in flight give the constrained tokens of one process, greedy and seeded."""
    _, path = parallel_tiny
    prompts = ["the cat", "a b", "xyz", "hello there", "q"]
    params = [SamplingParams(temperature=t, seed=7, max_tokens=30, structured_outputs=c)
              for t in (0.0, 1.0) for c in (Constraint(regex="[a-z]{3,8}( [a-z]{3,8}){2}"), Constraint(json=SCHEMA))]
    def run(llm):
        return [[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in params]
    expected = run(LLM(path, dtype="float32"))
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert run(llm) == expected
    finally:
        llm.engine.shutdown()

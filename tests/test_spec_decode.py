"""Speculative decoding (n-gram prompt lookup; the draft model's own cases are in test_spec_draft_model.py): its
settings, the proposer, the rejection sampler, the scheduler's policy, and the engine on tiny random models
(float32), where greedy output must equal the output without speculation token for token, seeded sampling too
(each verified position draws as the plain sampler would), and unseeded sampling must keep the model's
distribution (chi-square against the exact one)."""
import json
import math

import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import ConfigError
from qwenserve.config.speculative_config import SpeculativeConfig
from qwenserve.core.kv_cache_manager import KVCacheManager
from qwenserve.core.request import Sequence
from qwenserve.core.scheduler import Scheduler
from qwenserve.core.speculation import PAUSE_STEPS, Speculation
from qwenserve.core.step import ModelRunnerOutput
from qwenserve.sample.rejection_sampler import RejectionSampler
from qwenserve.sample.sampler import Sampler
from qwenserve.sample.structured_outputs import StructuredOutputsParams
from qwenserve.spec_decode.ngram_proposer import NgramProposer

from helpers import metric_value, record_preemptions, save_hf_dir, tiny_hf_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None, "min_acceptance_rate": 0}
GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---- settings -------------------------------------------------------------------------------------------------

def test_config_as_vllm_takes_it():
    spec = EngineConfig.from_kwargs(speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    ).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 4, 2, 5)
    # vLLM's defaults: neither bound given -> 5 and 5; one given -> both
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_max == 5
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    assert EngineConfig().speculative_config is None


def test_cli_flag():
    import argparse

    from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_config_from_args(args).speculative_config.num_speculative_tokens == 3


@pytest.mark.parametrize("value, pattern", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method 'medusa' is not one of ngram, draft_model"),
    ({"method": "ngram", "model": "/x", "num_speculative_tokens": 2}, "model '/x' is for method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must not exceed prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must"),
    ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 2}, "min_acceptance_rate must"),
    ("{not json", "speculative_config is not valid JSON"),
    ("[1, 2]", "speculative_config must be a JSON object"),
])
def test_bad_config_names_the_field(value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        EngineConfig.from_kwargs(speculative_config=value)


# ---- the proposer ---------------------------------------------------------------------------------------------

def test_ngram_proposer():
    p = NgramProposer(1, 3)
    # the longest suffix match wins ([2, 3] matched once, with 9 after it), not the more recent [3]
    assert p.propose([1, 2, 3, 9, 8, 5, 3, 7, 2, 3], 2) == [9, 8]
    # of equally long matches the most recent: [5, 6] after the second [1]
    assert p.propose([1, 4, 4, 1, 5, 6, 1], 2) == [5, 6]
    # past the end the copy goes on from its own guesses: a loop of period 2 is proposed in full
    assert p.propose([7, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert p.propose([5, 5, 5], 3) == [5, 5, 5]
    assert p.propose([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert p.propose([1, 2, 3, 1], 0) == []
    assert NgramProposer(2, 2).propose([1, 2, 3, 1], 3) == []  # [3, 1] never occurred before
    assert NgramProposer(2, 2).propose([1, 2, 3, 9, 2, 3], 3) == [9, 2, 3]


# ---- the rejection sampler ------------------------------------------------------------------------------------

class Row:
    """A sequence as the sampler reads it."""

    def __init__(self, params, token_ids=(0,), num_prompt_tokens=1, seed=None):
        self.params, self.token_ids, self.num_prompt_tokens = params, list(token_ids), num_prompt_tokens
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None

    @property
    def num_output_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's goodness of fit over the cells of nonzero expected probability (none may be observed outside)."""
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "a token of zero probability was drawn"
    expected = expected_probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def test_rejection_sampler_keeps_the_target_distribution():
    """One-hot drafts verified at two positions: the first token is distributed as p (with temperature, top-k and
    top-p applied), the second as p at its own position, and the first draft is accepted with probability p(x).
    20000 seeded samples: a 2% shift of mass between two cells fails the test (checked below)."""
    torch.manual_seed(0)
    vocab, n = 12, 20000
    logits = torch.randn(2, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95)
    sampler = Sampler("cpu")
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]  # the first draft has p around 0.2-0.3
    p = [sampler.probs(sampler.target_logits(logits[i:i + 1], [Row(params)])[0], [Row(params)])[0]
         for i in range(2)]
    p = [row / row.sum() for row in p]
    verify = RejectionSampler(sampler)
    first, second, accepted = torch.zeros(vocab), torch.zeros(vocab), 0
    for i in range(n):
        taken = verify(logits, [Row(params, seed=i)], [drafts[:1]]).token_ids[0]
        first[taken[0]] += 1
        if taken[0] == drafts[0]:
            accepted += 1
            second[taken[1]] += 1
    assert chi_square_p_value(first, p[0]) > 0.001
    assert chi_square_p_value(second, p[1]) > 0.001
    assert abs(accepted / n - float(p[0][drafts[0]])) < 4 * math.sqrt(0.25 / n)
    shifted = p[0].clone()
    top = shifted.argsort()
    shifted[top[-1]] -= 0.02
    shifted[top[-2]] += 0.02
    assert chi_square_p_value(first, shifted) < 0.001, "the test could not see a 2% shift"


def test_rejection_sampler_greedy_and_per_position_processing():
    """Greedy rows accept while the argmax equals the draft, then take the argmax. Each verified position is
    processed as if the drafts before it were output tokens: a repetition penalty sees them, and min_tokens
    counts them."""
    sampler, verify = Sampler("cpu"), None
    verify = RejectionSampler(sampler)
    logits = torch.full((4, 10), -5.0)
    logits[:, 3] = 2.0  # argmax 3 everywhere, 4 a close second
    logits[:, 4] = 1.9
    greedy = SamplingParams(temperature=0)
    assert verify(logits, [Row(greedy)], [[3, 3, 4]]).token_ids == [[3, 3, 3]]
    assert verify(logits, [Row(greedy)], [[3, 3, 3]]).token_ids == [[3, 3, 3, 3]]
    # the penalty applies to 3 once a draft 3 precedes the position (the prompt holds no 3)
    penalized = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert verify(logits, [Row(penalized)], [[3, 4, 4]]).token_ids == [[3, 4, 3]]
    # 3 is a stop token: banned while fewer than min_tokens = 2 tokens precede the position
    banned = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert verify(logits, [Row(banned)], [[4, 4, 4]]).token_ids == [[4, 4, 3]]
    # logprobs: one entry per token taken, each of its own position's raw logits
    with_logprobs = SamplingParams(temperature=0, logprobs=1)
    out = verify(logits[:2], [Row(with_logprobs)], [[3]])
    assert out.token_ids == [[3, 3]] and [list(e) for e in out.logprobs[0]] == [[3], [3]]


# ---- the scheduler's side -------------------------------------------------------------------------------------

def seq(seq_id, prompt, params=None):
    return Sequence(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=list(prompt),
                    num_prompt_tokens=len(prompt), params=params or SamplingParams(max_tokens=50))


def test_blocks_holding_drafts_are_never_cached():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    s = seq(0, range(7))
    assert kv.allocate(s, 7)
    s.num_computed_tokens = 7
    s.token_ids.append(99)  # sampled; 3 drafts verified with it would fill block 1 (positions 4-7) and more
    assert kv.allocate(s, 1 + 3)
    assert len(s.block_table) == 3
    assert s.num_registered_blocks == 2  # block 1 holds the 8 known tokens: cached; block 2 only drafts: not
    assert len(kv.cached) == 2


def run_step(sched, taken: dict[int, list[int]], drafts: dict[int, list[int]] = {}):
    """One step: schedule, then each sequence takes the given tokens (7 if not given) and, where the scheduler
    asked for drafts, proposes the given ones."""
    out = sched.schedule()
    result = ModelRunnerOutput(draft_token_ids={i: d for i, d in drafts.items() if i in out.num_draft_tokens_to_propose})
    for seq_id in out.num_scheduled_tokens:
        for token in taken.get(seq_id, [7]):
            result.seq_ids.append(seq_id)
            result.sampled_token_ids.append(token)
    sched.update_from_output(out, result)
    return out


def test_scheduler_verifies_drafts_and_advances_by_what_was_accepted():
    kv = KVCacheManager(32, 4)
    sched = Scheduler(kv, 8, 64, speculation=Speculation(3, max_model_len=100, min_acceptance_rate=0.2))
    a = seq(0, range(5))
    sched.add(a)
    out = run_step(sched, {0: [50]}, drafts={0: [51, 52, 53]})
    assert out.num_draft_tokens_to_propose == {0: 3}
    out = run_step(sched, {0: [51, 60]}, drafts={0: [1, 2, 3]})  # one draft accepted, then the target's own
    assert out.spec_token_ids == {0: [51, 52, 53]} and out.num_scheduled_tokens == {0: 4}
    assert a.num_computed_tokens == 7 and a.token_ids[5:] == [50, 51, 60]  # 60 is not computed yet
    assert len(a.block_table) * 4 >= 6 + 3  # the lookahead slots were allocated
    stats = sched.speculation.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    # the budget trims the drafts: 1 + 2 tokens
    sched.step_tokens = 3
    out = run_step(sched, {0: [1, 2, 3]})
    assert out.spec_token_ids == {0: [1, 2]} and a.num_computed_tokens == 10


def test_speculation_steps_aside():
    spec = Speculation(2, max_model_len=1000, disable_by_batch_size=2, min_acceptance_rate=0.3)
    sched = Scheduler(KVCacheManager(64, 4), 8, 64, speculation=spec)
    seqs = [seq(i, range(3)) for i in range(3)]
    for s in seqs[:2]:
        sched.add(s)
    run_step(sched, {})
    out = run_step(sched, {}, drafts={0: [1, 2], 1: [1, 2]})
    assert set(out.num_draft_tokens_to_propose) == {0, 1}
    sched.add(seqs[2])
    out = run_step(sched, {}, drafts={0: [1, 2]})  # admits the third
    assert out.spec_token_ids == {0: [1, 2], 1: [1, 2]}
    out = run_step(sched, {})  # three running: above disable_by_batch_size
    assert not out.spec_token_ids and not out.num_draft_tokens_to_propose
    sched.finish([seqs[2]])
    # low acceptance: a sequence whose drafts are all rejected pauses, then tries again
    s = seqs[0]
    s.spec_acceptance = 1.0
    rejected = 0
    while not s.spec_pause:
        s.spec_token_ids = [1, 2]
        out = run_step(sched, {0: [9]}, drafts={0: [1, 2]})
        rejected += out.spec_token_ids == {0: [1, 2]}
    assert rejected == 2  # 1 -> 0.5 -> 0.25 < 0.3
    proposals = []
    for _ in range(PAUSE_STEPS + 1):
        out = run_step(sched, {0: [9]}, drafts={0: [1, 2]})
        assert 0 not in out.spec_token_ids
        proposals.append(0 in out.num_draft_tokens_to_propose)
    assert proposals == [False] * PAUSE_STEPS + [True]
    # a constrained sequence never proposes
    constrained = seq(5, range(3), SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    assert spec.num_to_propose(constrained) == 0


def test_drafts_never_pass_max_tokens_or_the_context():
    spec = Speculation(4, max_model_len=20)
    s = seq(0, range(10), SamplingParams(max_tokens=6))
    s.token_ids += [1, 2, 3]  # 3 output tokens, the last not computed
    s.num_computed_tokens = 12
    s.spec_token_ids = [4, 5, 6, 7]
    assert spec.drafts_to_verify(s, budget=100) == [4, 5]  # 2 drafts + 1 token = the 3 max_tokens leaves
    s.params = SamplingParams(max_tokens=100)
    assert spec.drafts_to_verify(s, budget=100) == [4, 5, 6, 7]
    s.token_ids += [1] * 5
    s.num_computed_tokens += 5
    assert spec.drafts_to_verify(s, budget=100) == [4]  # 18 tokens: 2 more fit in max_model_len 20


# ---- the engine -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model(seed=41, max_position_embeddings=512)
    return hf, save_hf_dir(hf, str(tmp_path_factory.mktemp("spec")))


@pytest.fixture(scope="module")
def plain(tiny):
    return LLM(tiny[1], dtype="float32", kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def spec(tiny):
    return LLM(tiny[1], dtype="float32", kv_cache_memory="8MiB", speculative_config=NGRAM)


def repeating_prompts(seed=1):
    """Prompts that repeat a motif (the n-gram lookup finds it), and random ones."""
    g = torch.Generator().manual_seed(seed)
    motifs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 8, 13, 30)]
    return [m * 3 for m in motifs] + [torch.randint(0, 300, (25,), generator=g).tolist() for _ in range(2)]


def generate(llm, prompts, **params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)


def token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def record_verifications(llm) -> dict[str, list[tuple[int, int]]]:
    """request id -> (drafts, accepted) of each of its verifications from now on."""
    seen = {}
    speculation = llm.engine.scheduler.speculation
    record = speculation.record

    def spy(seq, num_drafts, num_taken):
        seen.setdefault(seq.request_id, []).append((num_drafts, num_taken - 1))
        return record(seq, num_drafts, num_taken)
    speculation.record = spy
    return seen


def assert_no_leak(llm):
    kv = llm.engine.kv
    kv.check_invariants([])
    assert kv.num_free_blocks == kv.num_blocks


def test_greedy_equals_without_speculation(plain, spec):
    prompts = repeating_prompts()
    seen = record_verifications(spec)
    before = spec.engine.stats()
    got = token_ids(generate(spec, prompts, max_tokens=48, **GREEDY))
    assert got == token_ids(generate(plain, prompts, max_tokens=48, **GREEDY))
    verifications = [v for v in seen.values()]
    accepted = [sum(a for _, a in v) for v in verifications]
    assert all(a > 0 for a in accepted), "a repeating prompt's drafts were never accepted"
    assert any(a < d for v in verifications for d, a in v), "no draft was rejected"
    assert len(set(accepted)) > 2, "the sequences accepted alike"
    stats = spec.engine.stats()
    assert stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"] == sum(accepted)
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"] > 0
    assert 1 < stats["spec_mean_acceptance_length"] <= 1 + NGRAM["num_speculative_tokens"]
    assert_no_leak(spec)


def test_chunked_prefill_and_prefix_caching(tiny, plain):
    """Prompts prefilled in chunks of 16 (no proposals until a prompt is done); then prompts that extend the
    earlier outputs, so that they hit blocks cached while the earlier ones decoded with drafts."""
    llm = LLM(tiny[1], dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16, speculative_config=NGRAM)
    prompts = repeating_prompts(seed=2)
    first = token_ids(generate(llm, prompts, max_tokens=40, **GREEDY))
    assert first == token_ids(generate(plain, prompts, max_tokens=40, **GREEDY))
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    longer = [p + out[:37] for p, out in zip(prompts, first)]
    hits = llm.engine.kv.hits
    assert token_ids(generate(llm, longer, max_tokens=12, **GREEDY)) == \
        token_ids(generate(plain, longer, max_tokens=12, **GREEDY))
    assert llm.engine.kv.hits - hits >= sum(len(p) // 16 * 16 for p in prompts)
    assert_no_leak(llm)


def test_preemption_while_speculating(tiny, plain):
    # 24 blocks of 16 tokens for six sequences that each grow to about 6 blocks
    llm = LLM(tiny[1], dtype="float32", kv_cache_memory=24 * 8192, speculative_config=NGRAM)
    prompts = repeating_prompts(seed=3)
    preempted = record_preemptions(llm)
    got = token_ids(generate(llm, prompts, max_tokens=60, **GREEDY))
    assert preempted, "nothing was preempted"
    assert got == token_ids(generate(plain, prompts, max_tokens=60, **GREEDY))
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    assert_no_leak(llm)


def test_seeded_sampling_takes_the_same_tokens(plain, spec):
    """Each verified position draws from the sequence's generator exactly as the plain sampler would, with
    every sampling parameter applied there: so a seeded request takes the same tokens with or without
    speculation, and again when repeated."""
    prompts = repeating_prompts(seed=4)
    params = [dict(temperature=0.7, seed=1), dict(temperature=1.0, top_k=5, seed=2),
              dict(temperature=0.9, top_p=0.8, min_p=0.05, seed=3),
              dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, seed=4),
              dict(temperature=0.6, frequency_penalty=0.7, min_tokens=30, seed=5),
              dict(temperature=0, repetition_penalty=1.2, seed=6)]

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(max_tokens=40, ignore_eos=True, **kw) for kw in params], use_tqdm=False)
        return token_ids(outs)
    seen = record_verifications(spec)
    got = run(spec)
    assert got == run(plain)
    assert got == run(spec)
    assert sum(a for v in seen.values() for _, a in v) > 0


def record_cut_tokens(llm) -> list[int]:
    """How many accepted tokens the output processor cut off a sequence it ended, for each such sequence."""
    cut = []
    processor = llm.engine.output_processor
    process = processor.process

    def spy(ran, runner_output, *args):
        before = {seq.seq_id: seq.num_tokens for seq in ran}
        outputs, finished = process(ran, runner_output, *args)
        cut.extend(before[seq.seq_id] - seq.num_tokens for seq in finished if before[seq.seq_id] > seq.num_tokens)
        return outputs, finished
    processor.process = spy
    return cut


def test_stops_cut_accepted_tokens(plain, spec):
    """A stop string or a stop token inside a run of accepted drafts ends the output there, as without
    speculation, and so does max_tokens; logprobs have one entry per token."""
    prompts = repeating_prompts(seed=1)
    # a stop token is only ever an accepted draft where it occurred before (drafts are copies) and did not stop the
    # output there: so one prompt ends inside an output's loop (256, 201, 25, 256, 201, 25, ...), whose
    # continuation, from the second step on, is accepted drafts
    loop = token_ids(generate(plain, [prompts[3]], max_tokens=8, **GREEDY))[0]
    prompts.append(prompts[3] + loop[:5])
    for kw in (dict(stop=["\x19\x19\x19"]), dict(stop=["\x19\x19\x19"], include_stop_str_in_output=True),
               dict(stop_token_ids=[loop[6]]), dict(max_tokens=17), dict(logprobs=2)):
        params = dict(max_tokens=48, **GREEDY) | kw
        cut = record_cut_tokens(spec)
        want, got = generate(plain, prompts, **params), generate(spec, prompts, **params)
        for w, g in zip(want, got):
            w, g = w.outputs[0], g.outputs[0]
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
                (w.token_ids, w.text, w.finish_reason, w.stop_reason), kw
            if "logprobs" in kw:
                assert len(g.logprobs) == len(g.token_ids)
                for a, b in zip(g.logprobs, w.logprobs):
                    assert a.keys() == b.keys()
                    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
                assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3
        if "stop" in kw or "stop_token_ids" in kw:
            assert sum(o.outputs[0].finish_reason == "stop" for o in got) >= 2
            assert cut, f"no stop fell inside a run of accepted drafts ({kw})"
    assert_no_leak(spec)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_distribution_is_the_models(tiny, method):
    """Unseeded sampling (top-k 3, so that three tokens cover each position) over many copies of one prompt that
    ends inside the model's own greedy loop (so drafts are often, not always, accepted): the joint distribution of
    the first three tokens (27 cells: the second and third come out of verification) matches the exact one
    computed from HF's logits, by chi-square; so does the marginal of the second token. 10000 samples: a shift of
    2% of the mass between two likely cells fails it. The draft model is the target itself, proposing its greedy
    tokens."""
    hf, path = tiny
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                            "disable_by_batch_size": None, "min_acceptance_rate": 0}
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB", speculative_config=spec)
    seen = record_verifications(llm)
    prompt = repeating_prompts(seed=1)[1]
    prompt += token_ids(generate(llm, [prompt], max_tokens=16, **GREEDY))[0]
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
    n = 10000
    torch.manual_seed(0)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    samples = [tuple(o.outputs[0].token_ids) for o in outs]

    def step_probs(prefix):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(prefix)])).logits[0, -1].double() / 1.5
        kth = logits.topk(3).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, -math.inf), dim=0)
    exact: dict[tuple, float] = {}
    p1 = step_probs(())
    for a in p1.nonzero().flatten().tolist():
        p2 = step_probs((a,))
        for b in p2.nonzero().flatten().tolist():
            p3 = step_probs((a, b))
            for c in p3.nonzero().flatten().tolist():
                exact[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    cells = sorted(exact)
    assert set(samples) <= set(cells)
    counts = torch.tensor([samples.count(c) for c in cells], dtype=torch.float64)
    expected = torch.tensor([exact[c] for c in cells], dtype=torch.float64)
    assert chi_square_p_value(counts, expected) > 0.001
    second = sorted({c[1] for c in cells})
    marginal = torch.tensor([sum(exact[c] for c in cells if c[1] == t) for t in second], dtype=torch.float64)
    second_counts = torch.tensor([sum(1 for s in samples if s[1] == t) for t in second], dtype=torch.float64)
    assert chi_square_p_value(second_counts, marginal) > 0.001
    shifted = marginal.clone()
    order = marginal.argsort()
    shifted[order[-1]] -= 0.02
    shifted[order[-2]] += 0.02
    assert chi_square_p_value(second_counts, shifted) < 0.001, "the test could not see a 2% shift"
    verified = [v for vs in seen.values() for v in vs]
    assert any(a > 0 for _, a in verified) and any(a < d for d, a in verified)


def test_counters_reach_metrics(spec):
    from qwenserve.entrypoints.openai.metrics import ServerMetrics
    generate(spec, repeating_prompts(seed=5)[:2], max_tokens=24, **GREEDY)
    stats = spec.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    text = ServerMetrics("tiny").render(stats).decode()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert metric_value(text, f"vllm:spec_decode_{key}_total", model_name="tiny",
                            engine="0") == stats["spec_" + key]
    per_position = [metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                    for i in range(len(stats["spec_accepted_per_position"]))]
    # a draft is accepted only with every draft before it: the counts fall with the position and add up
    assert per_position == sorted(per_position, reverse=True) and sum(per_position) == stats["spec_num_accepted_tokens"]


@pytest.mark.multiproc
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_worker_processes(tiny, plain, tp, pp):
    """Drafts cross the process boundary: the last stage proposes, every rank computes them (pipeline parallel:
    two steps in flight)."""
    llm = LLM(tiny[1], dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              speculative_config=NGRAM)
    try:
        prompts = repeating_prompts()
        assert token_ids(generate(llm, prompts, max_tokens=32, **GREEDY)) == \
            token_ids(generate(plain, prompts, max_tokens=32, **GREEDY))
        seeded = dict(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True)
        assert token_ids(generate(llm, prompts, **seeded)) == token_ids(generate(plain, prompts, **seeded))
        assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_bundled_model_greedy_equals_without_speculation():
    """The bundled model (float32, exact path) asked to edit code it was given: the same greedy tokens with and
    without speculation, some drafts accepted (4 of 16 when written: the model explains before it copies)."""
    import gc

    from qwenserve.tools.compare import prompt_ids
    code = ("def moving_average(values, window):\n    total = sum(values[:window])\n    out = [total / window]\n"
            "    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n"
            "        out.append(total / window)\n    return out\n")
    tokens = {}
    for speculative_config in (None, dict(NGRAM, num_speculative_tokens=4, prompt_lookup_min=2)):
        llm = LLM(None, dtype="float32", quantization="none", kv_cache_memory="256MiB",
                  speculative_config=speculative_config)
        prompt = prompt_ids(llm.get_tokenizer(), f"Rename `values` to `xs` in this function:\n{code}")[1]
        outs = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=64, **GREEDY), use_tqdm=False)
        tokens[speculative_config is None] = outs[0].outputs[0].token_ids
        stats = llm.engine.stats()
        del llm
        gc.collect()
    assert tokens[False] == tokens[True]
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"] > 0

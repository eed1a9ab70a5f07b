"""Speculative decoding with a draft model (spec_decode/draft_model.py) on tiny random models (float32): its
settings and checks (the same tokenizer), the scheduler's lookahead slots for the draft's K/V, and the engine,
where greedy output must equal the output without speculation token for token (seeded sampling too), a draft that
is the target itself must have every draft accepted (its K/V kept right across rejections, prefix-cache hits,
chunked prefill, preemption and forks), ids past the target's vocabulary are never proposed, a sequence holding
an id past the draft's rows decodes without proposals, and constrained requests beside speculating ones stay
exact."""
import re

import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import ConfigError
from qwenserve.core.kv_cache_manager import KVCacheManager
from qwenserve.core.scheduler import Scheduler
from qwenserve.core.speculation import Speculation
from qwenserve.sample.structured_outputs import StructuredOutputsParams as Constraint

from helpers import record_preemptions, save_hf_dir, tiny_hf_model, tiny_tokenizer
from test_spec_decode import (GREEDY, NGRAM, assert_no_leak, generate, record_verifications, repeating_prompts,
                              run_step, seq, token_ids)

TARGET_VOCAB = 320  # tiny_hf_model's


def draft_config(path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, "disable_by_batch_size": None,
            "min_acceptance_rate": 0}


# ---- settings -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, pattern", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "method 'draft_model' needs model"),
    ({"method": "draft_model", "model": "/x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "prompt_lookup_max is for method 'ngram'"),
    ({"method": "draft_model", "model": "/x", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
])
def test_bad_config_names_the_field(value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        EngineConfig.from_kwargs(speculative_config=value)


def test_draft_model_runs_in_one_worker():
    with pytest.raises(ConfigError, match=r"'draft_model' runs in one worker: tensor_parallel_size \(2\)"):
        EngineConfig.from_kwargs(speculative_config=draft_config("/x"), tensor_parallel_size=2)


def test_draft_checkpoint_is_checked_at_start(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"speculative_config: model '/nonexistent/draft': "):
        LLM(tiny, dtype="float32", kv_cache_memory="8MiB", speculative_config=draft_config("/nonexistent/draft"))
    # a tokenizer of other tokens (352 entries against 320): refused, naming both checkpoints
    other = save_hf_dir(tiny_hf_model(seed=5, vocab_size=352), str(tmp_path / "other"))
    with pytest.raises(ConfigError, match=re.escape(f"model '{other}' has another tokenizer than the target model "
                                                    f"'{tiny}' (352 tokens against the target's 320)")):
        LLM(tiny, dtype="float32", kv_cache_memory="8MiB", speculative_config=draft_config(other))


# ---- the scheduler's lookahead slots --------------------------------------------------------------------------

def test_proposing_sequences_get_lookahead_slots_or_no_proposals():
    """A sequence the worker proposes for gets k slots past its step's tokens (the draft writes its proposals'
    K/V there); short of blocks it goes without proposals (and drafts), and nobody is preempted for them."""
    kv = KVCacheManager(3, 4)
    sched = Scheduler(kv, 8, 64, speculation=Speculation(3, max_model_len=100, lookahead_slots=3))
    a = seq(0, range(5))
    sched.add(a)
    out = run_step(sched, {0: [50]}, drafts={0: [51, 52, 53]})
    assert out.num_draft_tokens_to_propose == {0: 3}
    assert len(a.block_table) == 2  # 5 prompt tokens + 3 lookahead slots
    out = run_step(sched, {0: [51, 52, 53, 54]}, drafts={0: [1, 2, 3]})  # all three accepted
    assert out.num_scheduled_tokens == {0: 4} and out.num_draft_tokens_to_propose == {0: 3}
    assert len(a.block_table) == 3  # positions up to 5 + 3 + 3
    out = run_step(sched, {0: [9]}, drafts={0: [1, 2, 3]})  # 1 + 3 drafts + 3 lookahead would need a 4th block
    assert out.num_scheduled_tokens == {0: 1} and not out.spec_token_ids and not out.num_draft_tokens_to_propose
    assert a.num_preemptions == 0 and len(a.block_table) == 3
    # admitted without its lookahead when only its own tokens fit
    sched = Scheduler(KVCacheManager(2, 4), 8, 64, speculation=Speculation(3, max_model_len=100, lookahead_slots=3))
    b = seq(1, range(7))
    sched.add(b)
    out = run_step(sched, {1: [9]})
    assert out.num_scheduled_tokens == {1: 7} and not out.num_draft_tokens_to_propose


# ---- the engine -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_hf_dir(tiny_hf_model(seed=41, max_position_embeddings=512), str(tmp_path_factory.mktemp("target")))


def save_with_target_tokenizer(model, path: str) -> str:
    """A draft checkpoint with the target's tokenizer, whatever its own embedding rows (as Qwen2.5-0.5B pads
    them to 151936 and the larger ones to 152064)."""
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(TARGET_VOCAB).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """Another, smaller model: one layer, half the width."""
    model = tiny_hf_model(seed=7, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=512)
    return save_with_target_tokenizer(model, str(tmp_path_factory.mktemp("small")))


@pytest.fixture(scope="module")
def padded_draft(tmp_path_factory):
    """The target's weights, slightly perturbed, with 32 more vocabulary rows whose LM-head rows dominate the
    logits: uncut, every proposal would be an id the target does not have."""
    target = tiny_hf_model(seed=41, max_position_embeddings=512)
    model = tiny_hf_model(seed=3, vocab_size=TARGET_VOCAB + 32, max_position_embeddings=512)
    with torch.no_grad():
        for (name, p), (_, q) in zip(model.named_parameters(), target.named_parameters()):
            if p.shape == q.shape:
                p.copy_(q + 0.001 * torch.randn_like(q))
            else:
                p[:TARGET_VOCAB] = q + 0.001 * torch.randn_like(q)
        model.lm_head.weight[TARGET_VOCAB:] = 50 * model.lm_head.weight[TARGET_VOCAB:]
    return save_with_target_tokenizer(model, str(tmp_path_factory.mktemp("padded")))


@pytest.fixture(scope="module")
def plain(tiny):
    return LLM(tiny, dtype="float32", kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def itself(tiny):
    """The target as its own draft: under greedy decoding it proposes the target's own tokens."""
    return LLM(tiny, dtype="float32", kv_cache_memory="8MiB", speculative_config=draft_config(tiny))


def prompts_of(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return repeating_prompts(seed) + [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 2, 40)]


def assert_all_accepted(llm, before: dict):
    stats = llm.engine.stats()
    drafts = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    assert drafts > 0
    assert stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"] == drafts


def test_target_as_its_own_draft_accepts_every_draft(itself, plain):
    """The strongest check of the draft's K/V: any position it got wrong would change a proposal."""
    prompts = prompts_of(1)
    before = itself.engine.stats()
    got = token_ids(generate(itself, prompts, max_tokens=48, **GREEDY))
    assert got == token_ids(generate(plain, prompts, max_tokens=48, **GREEDY))
    assert_all_accepted(itself, before)
    assert itself.engine.stats()["spec_mean_acceptance_length"] == pytest.approx(4, abs=0.3)
    assert_no_leak(itself)


@pytest.mark.parametrize("k", [1, 4])
def test_another_draft_keeps_greedy_output(tiny, small_draft, plain, k):
    llm = LLM(tiny, dtype="float32", kv_cache_memory="8MiB", speculative_config=draft_config(small_draft, k))
    prompts = prompts_of(2)
    seen = record_verifications(llm)
    assert token_ids(generate(llm, prompts, max_tokens=40, **GREEDY)) == \
        token_ids(generate(plain, prompts, max_tokens=40, **GREEDY))
    assert sum(d for v in seen.values() for d, _ in v) > 0
    assert_no_leak(llm)


def test_ids_past_the_target_vocabulary_are_never_proposed(tiny, padded_draft, plain):
    llm = LLM(tiny, dtype="float32", kv_cache_memory="8MiB", speculative_config=draft_config(padded_draft))
    proposer = llm.engine.executor.worker.model_runner.proposer
    proposed = []
    propose = proposer.propose_batch

    def spy(requests):
        out = propose(requests)
        proposed.extend(t for drafts in out for t in drafts)
        return out
    proposer.propose_batch = spy
    prompts = prompts_of(3)
    assert token_ids(generate(llm, prompts, max_tokens=32, **GREEDY)) == \
        token_ids(generate(plain, prompts, max_tokens=32, **GREEDY))
    assert proposed and max(proposed) < TARGET_VOCAB
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > stats["spec_num_draft_tokens"] / 2  # the perturbed target agrees


def test_a_sequence_with_ids_past_the_drafts_rows_decodes_without_proposals(small_draft, tmp_path):
    """A target padded to 352 rows over the same 320-token tokenizer as its 320-row draft (as Qwen2.5-7B against
    Qwen2.5-0.5B): a sequence holding an id from 320 up (in its prompt, or sampled by the target) gets no
    proposals, the draft never reads such an id, and the sequences beside it speculate on; greedy output is the
    plain one."""
    wide = save_with_target_tokenizer(tiny_hf_model(seed=21, vocab_size=TARGET_VOCAB + 32,
                                                    max_position_embeddings=512), str(tmp_path / "wide"))
    llm = LLM(wide, dtype="float32", kv_cache_memory="8MiB", speculative_config=draft_config(small_draft))
    proposer = llm.engine.executor.worker.model_runner.proposer
    read, proposed_for = [], []
    forward, propose = proposer.model.forward, proposer.propose_batch

    def spy_forward(input_ids, *args, **kwargs):
        read.append(int(input_ids.max()))
        return forward(input_ids, *args, **kwargs)

    def spy_propose(requests):
        out = propose(requests)
        for (_, tokens, _), drafts in zip(requests, out):
            proposed_for.append((max(tokens) >= TARGET_VOCAB, bool(drafts)))
        return out
    proposer.model.forward, proposer.propose_batch = spy_forward, spy_propose
    prompts = prompts_of(2)
    prompts[1] = prompts[1][:-1] + [TARGET_VOCAB + 13]
    got = token_ids(generate(llm, prompts, max_tokens=24, **GREEDY))
    plain = LLM(wide, dtype="float32", kv_cache_memory="8MiB")
    assert got == token_ids(generate(plain, prompts, max_tokens=24, **GREEDY))
    assert read and max(read) < TARGET_VOCAB
    # (holds an id past the draft's rows, got proposals): never both; each of the others seen
    assert (True, True) not in proposed_for and (True, False) in proposed_for and (False, True) in proposed_for
    assert_no_leak(llm)


def check_proposals(llm) -> list[bool]:
    """From now on, whether each proposal equals the draft model's greedy continuation computed from scratch
    (its own cache, its logits cut to the target's vocabulary)."""
    from qwenserve.worker.model_runner import full_logits
    proposer = llm.engine.executor.worker.model_runner.proposer
    checked = []
    propose = proposer.propose_batch

    def spy(requests):
        out = propose(requests)
        for (_, tokens, _), drafts in zip(requests, out):
            want = list(tokens)
            for _ in drafts:
                want.append(int(full_logits(proposer.model, want)[-1, :TARGET_VOCAB].argmax()))
            checked.append(drafts == want[len(tokens):])
        return out
    proposer.propose_batch = spy
    return checked


@pytest.mark.parametrize("case", ["preemption", "prefix hits"])
def test_proposals_are_the_drafts_own_greedy_continuation(tiny, padded_draft, plain, case):
    """Every proposal is what the draft model alone would propose: its K/V stay right where drafts are rejected
    (the perturbed target disagrees now and then), after preemption and on prefix-cache hits."""
    memory = 16 * 16384 if case == "preemption" else "8MiB"
    llm = LLM(tiny, dtype="float32", kv_cache_memory=memory, speculative_config=draft_config(padded_draft))
    checked = check_proposals(llm)
    preempted = record_preemptions(llm)
    seen = record_verifications(llm)
    prompts = prompts_of(8)
    first = token_ids(generate(llm, prompts, max_tokens=40, **GREEDY))
    assert first == token_ids(generate(plain, prompts, max_tokens=40, **GREEDY))
    if case == "preemption":
        assert preempted
    else:
        hits = llm.engine.kv.hits
        longer = [p + out[:20] for p, out in zip(prompts, first)]
        assert token_ids(generate(llm, longer, max_tokens=8, **GREEDY)) == \
            token_ids(generate(plain, longer, max_tokens=8, **GREEDY))
        assert llm.engine.kv.hits > hits
    verifications = [v for vs in seen.values() for v in vs]
    assert any(0 < a < d for d, a in verifications), "no verification rejected some drafts after accepting some"
    assert len(checked) > 50 and all(checked)
    assert_no_leak(llm)


def test_seeded_sampling_and_n_samples_take_the_same_tokens(itself, small_draft, tiny, plain):
    prompts = prompts_of(4)
    params = [dict(temperature=0.7, seed=1), dict(temperature=1.0, top_k=5, seed=2),
              dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, seed=4),
              dict(temperature=0.6, min_tokens=30, seed=5), dict(temperature=0.9, n=3, seed=6),
              dict(temperature=0, n=2), dict(temperature=0.5, seed=7), dict(temperature=0, seed=8),
              dict(temperature=1.2, top_p=0.9, seed=9)]

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(max_tokens=40, ignore_eos=True, **kw) for kw in params], use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]
    want = run(plain)
    assert run(itself) == want
    small = LLM(tiny, dtype="float32", kv_cache_memory="8MiB", speculative_config=draft_config(small_draft))
    assert run(small) == want
    assert_no_leak(itself)
    assert_no_leak(small)


def test_chunked_prefill_and_prefix_caching(tiny, plain):
    """Prompts prefilled in chunks of 16; then prompts extending the earlier outputs, which hit blocks cached
    while those decoded with drafts: the draft computes a hit prefix itself (it trusts no K/V it did not write
    for the sequence), so every draft is still accepted."""
    llm = LLM(tiny, dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16,
              speculative_config=draft_config(tiny))
    prompts = prompts_of(5)
    before = llm.engine.stats()
    first = token_ids(generate(llm, prompts, max_tokens=40, **GREEDY))
    assert first == token_ids(generate(plain, prompts, max_tokens=40, **GREEDY))
    assert_all_accepted(llm, before)
    longer = [p + out[:37] for p, out in zip(prompts, first)]
    hits, before = llm.engine.kv.hits, llm.engine.stats()
    assert token_ids(generate(llm, longer, max_tokens=12, **GREEDY)) == \
        token_ids(generate(plain, longer, max_tokens=12, **GREEDY))
    # some cached blocks are gone: the cache keeps no more free cached blocks than the peak in use
    # (core/kv_cache_manager.py), and the lookahead slots take blocks too
    assert llm.engine.kv.hits - hits >= 6 * 16
    assert_all_accepted(llm, before)
    assert_no_leak(llm)


def test_preemption_while_speculating(tiny, plain):
    """Short of blocks: sequences go without their lookahead and drafts first, then are preempted; one resumed
    recomputes its draft K/V in its new blocks, so every draft is still accepted."""
    llm = LLM(tiny, dtype="float32", kv_cache_memory=24 * 8192 * 2, speculative_config=draft_config(tiny))
    assert llm.engine.kv.num_blocks == 24  # the target's and the draft's layers in each block
    prompts = prompts_of(6)
    preempted = record_preemptions(llm)
    before = llm.engine.stats()
    got = token_ids(generate(llm, prompts, max_tokens=60, **GREEDY))
    assert preempted, "nothing was preempted"
    assert got == token_ids(generate(plain, prompts, max_tokens=60, **GREEDY))
    assert_all_accepted(llm, before)
    assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_requests_beside_speculating_ones(tiny, plain, method):
    """A constrained request never proposes (its grammar masks one token a step): its output is the one without
    speculation and matches its regex, while its unconstrained neighbours speculate."""
    spec = NGRAM if method == "ngram" else draft_config(tiny)
    llm = LLM(tiny, dtype="float32", kv_cache_memory="8MiB", speculative_config=spec)
    regex = "[a-z ]{10,40}"
    constrained = SamplingParams(temperature=0.0, max_tokens=50, structured_outputs=Constraint(regex=regex))
    greedy = SamplingParams(max_tokens=40, **GREEDY)
    prompts = [{"prompt_token_ids": p} for p in repeating_prompts(seed=7)]
    batch = [prompts[0], "the cat", prompts[1], "a b c", prompts[2]]
    params = [greedy, constrained, greedy, constrained, greedy]
    seen = record_verifications(llm)
    got = llm.generate(batch, params, use_tqdm=False)
    want = plain.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for i in (1, 3):
        assert re.fullmatch(regex, got[i].outputs[0].text) and got[i].outputs[0].finish_reason == "stop"
        assert got[i].request_id not in seen
    assert any(sum(a for _, a in v) for v in seen.values())
    assert_no_leak(llm)


def test_int8_kv_cache_holds_the_draft_too(tiny):
    """With kv_cache_dtype int8 the draft's layers are int8 codes in the same blocks: a block holds both models'
    bytes, and greedy output is the int8 engine's own."""
    plain8 = LLM(tiny, dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype="int8")
    llm = LLM(tiny, dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype="int8",
              speculative_config=draft_config(tiny))
    assert llm.engine.kv.num_blocks * 2 == plain8.engine.kv.num_blocks
    prompts = prompts_of(9)
    before = llm.engine.stats()
    assert token_ids(generate(llm, prompts, max_tokens=32, **GREEDY)) == \
        token_ids(generate(plain8, prompts, max_tokens=32, **GREEDY))
    stats = llm.engine.stats()
    drafts = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    assert stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"] > 0.9 * drafts > 0
    assert_no_leak(llm)

"""The engine on tiny random models (float32): batching, chunking, preemption and prefix caching never change
greedy tokens, which equal HF transformers'; sampling parameters behave as the OpenAI API documents."""
import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.tools.compare import hf_greedy

from helpers import record_preemptions, save_hf_dir, tiny_hf_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model(seed=41, num_key_value_heads=2, max_position_embeddings=512)
    return hf, save_hf_dir(hf, str(tmp_path_factory.mktemp("engine")))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[1], dtype="float32", kv_cache_memory="8MiB")


def prompts(lengths, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def run(llm, ps, **params):
    return llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(**params), use_tqdm=False)


def assert_no_leak(llm):
    kv = llm.engine.kv
    kv.check_invariants([])
    assert kv.num_free_blocks == kv.num_blocks, "blocks still referenced after every request ended"


@pytest.mark.slow
def test_mixed_batch_equals_each_alone_and_hf(tiny, llm):
    hf, _ = tiny
    ps = prompts([3, 17, 40, 1, 64, 9, 33, 120])
    batched = token_ids(run(llm, ps, max_tokens=20, **GREEDY))
    alone = [token_ids(run(llm, [p], max_tokens=20, **GREEDY))[0] for p in ps]
    assert batched == alone
    assert batched == [hf_greedy(hf, p, 20)[0] for p in ps]
    assert_no_leak(llm)


@pytest.mark.slow
def test_chunked_prefill_gives_the_same_tokens(tiny):
    hf, path = tiny
    ps = prompts([150, 70, 5], seed=1)
    chunked = LLM(path, dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=32)
    assert token_ids(run(chunked, ps, max_tokens=12, **GREEDY)) == [hf_greedy(hf, p, 12)[0] for p in ps]
    assert_no_leak(chunked)


@pytest.mark.slow
def test_grouped_sdpa_decode_without_kernels_equals_hf(tiny, monkeypatch):
    """Without the CPU kernels, a decode batch of 8+ sequences whose contexts differ more than 2x runs as 4
    SDPA groups, each padded only to its own longest context; the tokens stay HF's."""
    from qwenserve import kernels
    from qwenserve.worker.input_batch import MAX_DECODE_GROUPS, InputBatch

    hf, path = tiny
    group_counts = []
    original = InputBatch._decode_groups

    def spy(self, *args):
        groups = original(self, *args)
        group_counts.append(len(groups))
        return groups
    monkeypatch.setattr(InputBatch, "_decode_groups", spy)
    with kernels.disabled():  # the layers and the runner choose their implementation when built
        plain = LLM(path, dtype="float32", kv_cache_memory="8MiB")
    ps = prompts([3, 5, 8, 12, 40, 60, 90, 120], seed=21)
    assert token_ids(run(plain, ps, max_tokens=12, **GREEDY)) == [hf_greedy(hf, p, 12)[0] for p in ps]
    assert max(group_counts) == MAX_DECODE_GROUPS
    assert_no_leak(plain)


@pytest.mark.slow
def test_preemption_keeps_greedy_output(tiny, llm):
    _, path = tiny
    ps = prompts([40, 50, 60, 45, 55, 35], seed=2)
    ample = token_ids(run(llm, ps, max_tokens=60, **GREEDY))
    # 2 kv heads * 16 dims * 2 layers * 2 (K, V) * 4 bytes = 512 bytes per token: 96 KiB = 192 tokens,
    # far less than the six requests need together (about 640 tokens)
    tight = LLM(path, dtype="float32", kv_cache_memory=96 * 1024)
    preempted = record_preemptions(tight)
    assert token_ids(run(tight, ps, max_tokens=60, **GREEDY)) == ample
    assert preempted, "the test did not exercise preemption"
    assert_no_leak(tight)


@pytest.mark.slow
def test_prefix_caching_reuses_blocks_without_changing_output(tiny, llm):
    _, path = tiny
    shared = prompts([100], seed=3)[0]
    ps = [shared + tail for tail in prompts([7, 20, 1], seed=4)]
    first = run(llm, ps[:1], max_tokens=10, **GREEDY)
    rest = run(llm, ps[1:], max_tokens=10, **GREEDY)
    assert first[0].num_cached_tokens == 0 or first[0].num_cached_tokens % 16 == 0
    for out in rest:
        assert out.num_cached_tokens == 96  # the six full blocks of the 100-token prefix
    no_cache = LLM(path, dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False)
    plain = run(no_cache, ps, max_tokens=10, **GREEDY)
    assert token_ids(first + rest) == token_ids(plain)
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert_no_leak(llm)


def test_identical_prompts_in_one_batch_share_blocks(tiny, llm):
    p = prompts([70], seed=5)[0]
    outs = run(llm, [p, p, p], max_tokens=8, **GREEDY)
    assert len({tuple(t) for t in token_ids(outs)}) == 1
    assert [o.num_cached_tokens for o in outs][1:] == [64, 64]


@pytest.mark.slow
def test_n_samples_share_prompt_blocks_and_are_reproducible(tiny, llm):
    p = prompts([50], seed=6)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    eng = llm.engine
    eng.add_request("fork", {"prompt_token_ids": p}, params)
    eng.step()  # the first sample's prefill; its siblings then take its 3 full prompt blocks
    parent, *children = eng.output_processor.requests["fork"].seqs
    for child in children:
        assert child.block_table[:3] == parent.block_table[:3]
    assert all(eng.kv.ref_cnt[b] == 4 for b in parent.block_table[:3])
    while eng.has_unfinished_requests():
        eng.step()
    again = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in again.outputs] == [12] * 4
    assert len({tuple(c.token_ids) for c in again.outputs}) > 1  # different seeds per sample
    third = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in third.outputs] == [c.token_ids for c in again.outputs]
    assert_no_leak(llm)


@pytest.mark.slow
def test_seeded_sampling_is_independent_of_the_batch(llm):
    p = prompts([20], seed=7)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": p}], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in prompts([5, 30, 12], seed=8)]
    noisy = SamplingParams(temperature=1.2, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(others[:2] + [{"prompt_token_ids": p}] + others[2:], [noisy, noisy, seeded, noisy],
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=8, max_tokens=16, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": p}], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_logprobs_match_hf_log_softmax(tiny, llm):
    hf, _ = tiny
    p = prompts([25], seed=9)[0]
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2,
                                                                 **GREEDY), use_tqdm=False)[0]
    comp = out.outputs[0]
    full = p + comp.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    assert len(comp.logprobs) == 6
    total = 0.0
    for step, entry in enumerate(comp.logprobs):
        row = ref[len(p) - 1 + step]
        chosen = comp.token_ids[step]
        assert chosen in entry and entry[chosen].rank == 1  # greedy: the chosen token is the top one
        assert len(entry) == 3
        for tid, lp in entry.items():
            assert abs(lp.logprob - float(row[tid])) < 1e-4
        assert [lp.rank for lp in sorted(entry.values(), key=lambda x: -x.logprob)] == [1, 2, 3]
        total += entry[chosen].logprob
    assert abs(comp.cumulative_logprob - total) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for pos in range(1, len(p)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[p[pos]].logprob - float(ref[pos - 1, p[pos]])) < 1e-4
        assert len(entry) <= 3


def test_max_tokens_min_tokens_and_stop_token_ids(llm):
    p = prompts([10], seed=10)[0]
    free = run(llm, [p], max_tokens=12, **GREEDY)[0].outputs[0]
    assert len(free.token_ids) == 12 and free.finish_reason == "length"
    stop_id = free.token_ids[4]
    first_hit = free.token_ids.index(stop_id)
    stopped = run(llm, [p], max_tokens=12, stop_token_ids=[stop_id], **GREEDY)[0].outputs[0]
    assert stopped.token_ids == free.token_ids[:first_hit + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    held = run(llm, [p], max_tokens=12, min_tokens=first_hit + 2, stop_token_ids=[stop_id], **GREEDY)[0].outputs[0]
    assert len(held.token_ids) >= first_hit + 2
    assert stop_id not in held.token_ids[:first_hit + 2]


@pytest.mark.slow
def test_eos_ends_a_request_unless_ignored(tiny):
    _, path = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB")
    p = prompts([12], seed=11)[0]
    free = run(llm, [p], max_tokens=20, **GREEDY)[0].outputs[0].token_ids
    eos = free[5]
    llm.engine.input_processor.eos_token_ids = frozenset({eos})  # pretend the checkpoint's EOS is a token greedy decoding emits
    natural = run(llm, [p], max_tokens=20, temperature=0.0)[0].outputs[0]
    assert natural.token_ids == free[:free.index(eos) + 1]
    assert natural.finish_reason == "stop" and natural.stop_reason is None
    ignored = run(llm, [p], max_tokens=20, **GREEDY)[0].outputs[0]
    assert ignored.token_ids == free and ignored.finish_reason == "length"


@pytest.mark.slow
def test_stop_strings_end_the_text_before_them(llm):
    p = prompts([15], seed=15)[0]
    free = run(llm, [p], max_tokens=40, **GREEDY)[0].outputs[0]
    text = free.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text.index(stop)
    eng = llm.engine
    eng.add_request("s", {"prompt_token_ids": p}, SamplingParams(max_tokens=40, stop=[stop], **GREEDY))
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.outputs[0].text_delta)
            final = out.outputs[0]
    assert final.text == text[:cut] and "".join(deltas) == text[:cut]  # nothing streamed past the stop
    assert final.finish_reason == "stop" and final.stop_reason == stop
    kept = run(llm, [p], max_tokens=40, stop=[stop], include_stop_str_in_output=True, **GREEDY)[0].outputs[0]
    assert kept.text == text[:cut + len(stop)]


def test_invalid_parameters_name_the_parameter(llm):
    for kwargs, name in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
                         (dict(n=0), "n"), (dict(top_k=-5), "top_k"), (dict(max_tokens=0), "max_tokens"),
                         (dict(min_p=2), "min_p"), (dict(logprobs=99), "logprobs"),
                         (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
                         (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[""]), "stop")]:
        with pytest.raises(ValueError, match=rf"^{name} "):
            SamplingParams(**kwargs)


def test_bad_prompts_leave_the_engine_clean(llm):
    with pytest.raises(ValueError, match="maximum context length is 512 tokens. However, you requested 600 tokens "
                                         "\\(500 in the messages, 100 in the completion\\)"):
        llm.generate([{"prompt_token_ids": [1] * 500}], SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids must be integers in \\[0, 320\\)"):
        llm.generate([{"prompt_token_ids": [1, 999]}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leak(llm)


def test_abort_frees_blocks_at_once(llm):
    eng = llm.engine
    eng.add_request("a", {"prompt_token_ids": prompts([90], seed=12)[0]}, SamplingParams(max_tokens=50, **GREEDY))
    eng.add_request("b", {"prompt_token_ids": prompts([30], seed=13)[0]}, SamplingParams(max_tokens=5, **GREEDY))
    eng.step()
    eng.step()
    out = eng.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    live = [s for r in eng.output_processor.requests.values() for s in r.seqs if not s.finished]
    eng.kv.check_invariants(live)
    while eng.has_unfinished_requests():
        eng.step()
    assert_no_leak(llm)


def test_penalties_change_the_distribution_as_documented(llm):
    p = prompts([8], seed=14)[0]
    base = run(llm, [p], max_tokens=30, **GREEDY)[0].outputs[0].token_ids
    assert len(set(base)) < len(base), "the unpenalized output must repeat itself for this test to mean anything"
    rep = run(llm, [p], max_tokens=30, repetition_penalty=10.0, **GREEDY)[0].outputs[0].token_ids
    freq = run(llm, [p], max_tokens=30, frequency_penalty=2.0, presence_penalty=2.0, **GREEDY)[0].outputs[0].token_ids
    assert len(set(rep)) > len(set(base)) and len(set(freq)) > len(set(base))
    assert len(set(rep) & set(p)) <= len(set(base) & set(p))  # repetition penalty also covers prompt tokens


def test_penalties_equal_their_formulas():
    """Repetition (prompt and output tokens: positive logits divided, negative multiplied), then frequency
    (per occurrence) and presence (once) on output tokens only, as vLLM and the OpenAI API define them."""
    from types import SimpleNamespace

    from qwenserve.sample.logits_processors import apply_penalties

    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    prompt, output = [0, 1], [2, 2, 3]
    row = SimpleNamespace(params=SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
                          token_ids=prompt + output, num_prompt_tokens=len(prompt))
    got = apply_penalties(logits, [row])
    # token 0: prompt, positive -> 2/2; 1: prompt, negative -> -2*2; 2: output x2 -> 1/2 - 2*0.5 - 0.25;
    # 3: output x1 -> -1*2 - 0.5 - 0.25; 4 and 5 unseen
    expected = torch.tensor([[1.0, -4.0, 0.5 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 0.5, 3.0]])
    torch.testing.assert_close(got, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]]))  # the input is not modified
    plain = SimpleNamespace(params=SamplingParams(), token_ids=prompt + output, num_prompt_tokens=len(prompt))
    assert apply_penalties(logits, [plain]) is logits  # no penalty: no copy

def test_random_sampling_draws_tokens_at_their_probabilities():
    """Each row's token is drawn with the probability softmax(logits / temperature) gives it: frequencies over
    many rows within 5 standard deviations of it, and a token with no mass (top-k cut) never drawn."""
    from types import SimpleNamespace

    from qwenserve.sample.sampler import Sampler

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0]))
    params = SamplingParams(temperature=1.0, top_k=4)
    rows = [SimpleNamespace(params=params, generator=None, token_ids=[0], num_prompt_tokens=1, num_output_tokens=0)
            for _ in range(20000)]
    torch.manual_seed(11)
    tokens = torch.tensor(Sampler("cpu")(logits.expand(len(rows), -1).contiguous(), rows).token_ids)
    counts = torch.bincount(tokens, minlength=5).double()
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], dtype=torch.double) * len(rows)
    sigma = (expected * (1 - expected / len(rows))).sqrt()
    assert counts[4] == 0
    assert ((counts - expected).abs()[:4] < 5 * sigma[:4]).all(), counts

"""Property-based: random interleavings of add / step / abort / finish on the KV cache manager and the
scheduler never leak or double-free a block, keep the worker's view of every block table (built from the
SchedulerOutput deltas only) equal to the scheduler's, keep reference counts equal to the live block tables, and
leave every block free or cached when nothing is live, and touch no more distinct blocks (the cache's resident
memory) than the peak in use allows. No model runs: a step 'computes' what it scheduled. With two steps in
flight (pipeline parallel), no sequence is in both, and none in flight is preempted. With LoRA adapters, the
running sequences never use more than max_loras of them, and requests waiting for a slot still finish. With
speculative decoding the fake worker proposes random drafts and accepts a random number of them; no block holding
a draft is ever cached."""
import random
from collections import deque

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from qwenserve.config.engine_config import SchedulerConfig
from qwenserve.core.kv_cache_manager import KVCacheManager
from qwenserve.core.request import Sequence, Status
from qwenserve.core.scheduler import Scheduler
from qwenserve.core.speculation import Speculation
from qwenserve.core.step import ModelRunnerOutput
from qwenserve.lora.request import LoRARequest
from qwenserve.sample.sampling_params import SamplingParams

BLOCK = 4
PIPELINED_STEP_TOKENS = SchedulerConfig().pipelined_step_tokens

# add: prompt length, max_tokens, shared-prefix kind, n, adapter (0: the base model)
add = st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 24), st.integers(0, 3), st.integers(1, 3),
                st.integers(0, 3))
op = st.one_of(
    add, add,
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("finish"), st.integers(0, 1000)),
)


class Harness:
    """The scheduler and KV manager driven through their step contract, with a fake worker that keeps block
    tables from the SchedulerOutput deltas alone (as the real one does) and samples random tokens."""

    def __init__(self, num_blocks, budget, max_seqs, prefix_caching, concurrent=1, max_loras=None, num_spec_tokens=0):
        self.kv = KVCacheManager(num_blocks, BLOCK, prefix_caching)
        speculation = Speculation(num_spec_tokens, max_model_len=1000) if num_spec_tokens else None
        self.sched = Scheduler(self.kv, max_seqs, budget, concurrent, PIPELINED_STEP_TOKENS, max_loras, speculation)
        self.worker_adapters: dict[int, LoRARequest | None] = {}
        self.requests: dict[str, list[Sequence]] = {}
        self.worker_tables: dict[int, list[int]] = {}
        self.worker_tokens: dict[int, list[int]] = {}
        self.in_flight: deque = deque()  # (scheduler output, ids of the sequences that sample)
        self.ids = 0
        self.rng = random.Random(0)
        self.resumptions = 0  # sequences run again after a preemption
        self.peak_live_blocks = 0  # the most blocks held at once, measured after every allocation
        allocate = self.kv.allocate

        def allocate_and_measure(*args):
            allocated = allocate(*args)
            self.peak_live_blocks = max(self.peak_live_blocks, self.kv.num_blocks - self.kv.num_free_blocks)
            return allocated
        self.kv.allocate = allocate_and_measure

    def live(self):
        return [s for seqs in self.requests.values() for s in seqs if not s.finished]

    def add(self, prompt_len, max_tokens, prefix_kind, n, adapter=0):
        # a few shared prefixes make prefix-cache hits likely
        prefix = [prefix_kind] * (prompt_len - 3) if prefix_kind else []
        prompt = (prefix + [self.rng.randrange(50) for _ in range(prompt_len)])[:prompt_len]
        if self.kv.blocks_needed(prompt_len + max_tokens) > self.kv.num_blocks:
            return  # the engine rejects such a request up front
        rid = str(self.ids)
        self.ids += 1
        params = SamplingParams(max_tokens=max_tokens, n=n)
        lora = LoRARequest(f"a{adapter}", adapter, f"/adapters/{adapter}") if adapter else None
        seqs = [Sequence(seq_id=self.ids * 10 + i, request_id=rid, index=i, token_ids=list(prompt),
                         num_prompt_tokens=prompt_len, params=params, lora_request=lora,
                         cache_salt=lora.cache_salt if lora else b"") for i in range(n)]
        seqs[0].fork_children = seqs[1:]
        self.requests[rid] = seqs
        self.sched.add(seqs[0])

    def step(self):
        """Submit steps while the queue has room (as the engine does), then complete the oldest."""
        while len(self.in_flight) < self.sched.max_concurrent_batches:
            out = self.sched.schedule()
            assert out.total_num_scheduled_tokens <= self.sched.max_num_batched_tokens
            assert len(self.sched.running) <= self.sched.max_num_seqs
            if out.is_empty:
                break  # not sent: its ended ids must come with the next one
            self.in_flight.append((out, self._send(out)))
        if not self.in_flight:
            return
        out, sampling = self.in_flight.popleft()
        by_id = {s.seq_id: s for s in self.live()}
        runner_out = ModelRunnerOutput()
        for seq_id in sampling:
            if seq_id in by_id:
                drafts = out.spec_token_ids.get(seq_id, [])
                taken = drafts[:self.rng.randint(0, len(drafts))] + [self.rng.randrange(50)]
                runner_out.seq_ids += [seq_id] * len(taken)
                runner_out.sampled_token_ids += taken
                if seq_id in out.num_draft_tokens_to_propose:
                    num = self.rng.randint(0, out.num_draft_tokens_to_propose[seq_id])
                    runner_out.draft_token_ids[seq_id] = [self.rng.randrange(50) for _ in range(num)]
        ran = self.sched.update_from_output(out, runner_out)
        assert [s.seq_id for s in ran] == [i for i in out.num_scheduled_tokens if i in by_id]
        for i in runner_out.seq_ids:
            assert by_id[i].num_output_tokens <= by_id[i].params.max_tokens, "drafts went past max_tokens"
        self.sched.finish([by_id[i] for i in dict.fromkeys(runner_out.seq_ids)
                           if by_id[i].num_output_tokens >= by_id[i].params.max_tokens])
        self._drop_finished()

    def _send(self, out) -> list[int]:
        """What a worker does with the step's deltas; returns the sequences that will sample."""
        for seq_id in out.finished_seq_ids:
            del self.worker_tables[seq_id]
            del self.worker_tokens[seq_id]
            del self.worker_adapters[seq_id]
        for new in out.new_seqs:
            assert new.seq_id not in self.worker_tables
            self.worker_tables[new.seq_id] = list(new.block_ids)
            self.worker_tokens[new.seq_id] = list(new.token_ids)
            self.worker_adapters[new.seq_id] = new.lora_request
        for cached in out.cached_seqs:
            table = self.worker_tables[cached.seq_id]
            self.resumptions += cached.resumed_from_preemption
            self.worker_tables[cached.seq_id] = (list(cached.new_block_ids) if cached.resumed_from_preemption
                                                 else table + cached.new_block_ids)
            self.worker_tokens[cached.seq_id] += cached.new_token_ids
        by_id = {s.seq_id: s for s in self.live()}
        earlier = {i for o, _ in self.in_flight for i in o.num_scheduled_tokens}
        sampling = []
        for seq_id, n in out.num_scheduled_tokens.items():
            seq = by_id[seq_id]
            drafts = len(out.spec_token_ids.get(seq_id, ()))
            assert not drafts or seq.num_tokens - seq.num_computed_tokens == 1, "drafts for a sequence not decoding"
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n, "no cache slots for the drafts"
            n -= drafts
            assert seq_id not in earlier, "a sequence is in two steps in flight"
            assert seq.status == Status.RUNNING
            assert n >= 1 and seq.num_computed_tokens + n <= seq.num_tokens
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n
            assert self.worker_tables[seq_id] == seq.block_table, "the worker's block table drifted"
            assert self.worker_tokens[seq_id] == seq.token_ids, "the worker's tokens drifted"
            assert self.worker_adapters[seq_id] == seq.lora_request
            if seq.num_computed_tokens + n == seq.num_tokens:
                sampling.append(seq_id)
        if self.sched.max_loras is not None:
            adapters = {s.lora_int_id for s in self.sched.running if s.lora_request is not None}
            assert len(adapters) <= self.sched.max_loras, f"running sequences use adapters {adapters}"
        return sampling

    def end(self, index):
        if not self.requests:
            return
        rid = sorted(self.requests)[index % len(self.requests)]
        seqs = self.requests.pop(rid)
        self.sched.finish([s for s in seqs if not s.finished])

    def _drop_finished(self):
        for rid in [r for r, seqs in self.requests.items() if all(s.finished for s in seqs)]:
            del self.requests[rid]

    def check(self):
        self.kv.check_invariants(self.live())
        for seq in self.live():  # every block registered in the prefix cache holds the sequence's own tokens
            assert seq.num_registered_blocks * BLOCK <= seq.num_tokens
            fresh = Sequence(seq_id=0, request_id="", index=0, token_ids=seq.token_ids,
                             num_prompt_tokens=seq.num_prompt_tokens, params=seq.params, cache_salt=seq.cache_salt)
            self.kv._hash_blocks(fresh, seq.num_registered_blocks)
            assert seq.block_hashes[:seq.num_registered_blocks] == fresh.block_hashes
        # a fresh block is touched only when no used block is free (without prefix caching), or while the free
        # ones, all cached, are fewer than the peak in use: the touched ids follow the peak
        assert self.kv.peak_live == self.peak_live_blocks
        if self.kv.enable_prefix_caching:
            assert self.kv.num_touched <= 2 * self.peak_live_blocks, "blocks were touched beyond twice the peak"
        else:
            assert self.kv.num_touched == self.peak_live_blocks, "blocks were touched beyond the peak in use"
        for seq in self.live():
            assert seq.status in (Status.WAITING, Status.RUNNING)
        for seq in self.sched.waiting:
            assert not seq.block_table and seq.num_computed_tokens == 0, "a waiting sequence holds blocks"
            assert seq.seq_id not in self.sched.in_flight, "a sequence in flight was preempted"


# two samples that cannot fit together, two steps in flight: they used to preempt each other in turn forever
@pytest.mark.slow
@example(ops=[("step",)] * 9 + [("add", 1, 7, 0, 1)] + [("step",)] * 3 + [("add", 20, 6, 0, 2)], num_blocks=9,
         budget=10, max_seqs=2, prefix_caching=False, concurrent=2, max_loras=None)
@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, min_size=15, max_size=60), num_blocks=st.integers(8, 24), budget=st.integers(1, 48),
       max_seqs=st.integers(2, 6), prefix_caching=st.booleans(), concurrent=st.sampled_from([1, 2]),
       max_loras=st.sampled_from([None, 1, 2]))
def test_random_operations_keep_blocks_consistent(ops, num_blocks, budget, max_seqs, prefix_caching, concurrent,
                                                  max_loras):
    run_random_operations(Harness(num_blocks, budget, max_seqs, prefix_caching, concurrent, max_loras), ops)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op, min_size=15, max_size=60), num_blocks=st.integers(8, 24), budget=st.integers(1, 48),
       max_seqs=st.integers(2, 6), prefix_caching=st.booleans(), concurrent=st.sampled_from([1, 2]),
       num_spec_tokens=st.integers(1, 5))
def test_random_operations_with_speculation_keep_blocks_consistent(ops, num_blocks, budget, max_seqs, prefix_caching,
                                                                   concurrent, num_spec_tokens):
    h = Harness(num_blocks, budget, max_seqs, prefix_caching, concurrent, num_spec_tokens=num_spec_tokens)
    run_random_operations(h, ops)
    event(f"drafts accepted: {h.sched.speculation.stats.num_accepted_tokens > 0}")


def run_random_operations(h: Harness, ops) -> None:
    for o in ops:
        if o[0] == "add":
            h.add(*o[1:])
        elif o[0] == "step":
            h.step()
        else:
            h.end(o[1])
        h.check()
    # whatever is left runs to completion: no deadlock, then nothing is held
    for _ in range(2000):
        if not h.requests:
            break
        h.step()
        h.check()
    assert not h.requests, "requests never finished"
    while h.in_flight:  # steps of aborted sequences
        h.step()
    assert not h.sched.in_flight
    event(f"resumed after preemption: {h.resumptions > 0}")
    event(f"prefix hits: {h.kv.hits > 0}")
    assert all(c == 0 for c in h.kv.ref_cnt)
    assert h.kv.num_free_blocks == h.kv.num_blocks  # every block is free or (evictable) cached


def test_pipelined_steps_prefill_in_smaller_steps():
    """With two steps in flight a long prompt is prefilled in steps of at most PIPELINED_STEP_TOKENS (so the
    pipeline's stages overlap on it); with one in flight, in one step up to the whole budget."""
    for concurrent, expected in ((1, [4 * PIPELINED_STEP_TOKENS]), (2, [PIPELINED_STEP_TOKENS] * 4)):
        h = Harness(num_blocks=600, budget=4096, max_seqs=4, prefix_caching=False, concurrent=concurrent)
        sizes = []
        schedule = h.sched.schedule

        def recording_schedule():
            out = schedule()
            sizes.append(out.total_num_scheduled_tokens)
            return out
        h.sched.schedule = recording_schedule
        h.add(4 * PIPELINED_STEP_TOKENS, 1, 0, 1)
        while h.requests:
            h.step()
        assert [n for n in sizes if n] == expected


def test_a_failed_step_ends_the_sequences_that_adopted_its_unwritten_blocks():
    """With two steps in flight, a request scheduled in the second may adopt full blocks the first registered; if
    the first fails those blocks are never written, so that request fails too, and their cache entries go."""
    kv = KVCacheManager(32, BLOCK, True)
    sched = Scheduler(kv, 4, 64, 2, PIPELINED_STEP_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=4)
    prompt = list(range(10, 23))  # three full blocks and one token
    first, second, other = (Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=list(tokens),
                                     num_prompt_tokens=len(tokens), params=params)
                            for i, tokens in enumerate([prompt, prompt, [7, 8, 9]]))
    sched.add(first)
    step_one = sched.schedule()
    sched.add(second)
    sched.add(other)
    step_two = sched.schedule()
    assert second.num_cached_tokens == 3 * BLOCK and set(step_two.num_scheduled_tokens) == {1, 2}
    ended = sched.drop_step(step_one)
    assert ended == [first, second]  # not `other`, which shares nothing with the failed step
    assert not kv.cached

"""Property-based: random interleavings of add / step / abort / finish on the KV cache manager and the
scheduler never leak or double-free a block, keep reference counts equal to the live block tables, and
leave every block free or cached when nothing is live. No model runs: a step 'computes' what it scheduled."""
import random

from hypothesis import event, given, settings
from hypothesis import strategies as st

from qwenserve.kv_cache_manager import KVCacheManager
from qwenserve.sampling_params import SamplingParams
from qwenserve.scheduler import Scheduler
from qwenserve.sequence import Sequence, Status

BLOCK = 4

add = st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 24), st.integers(0, 3), st.integers(1, 3))
op = st.one_of(
    add, add,
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("finish"), st.integers(0, 1000)),
)


class Harness:
    def __init__(self, num_blocks, budget, max_seqs, prefix_caching):
        self.kv = KVCacheManager(num_blocks, BLOCK, prefix_caching)
        self.sched = Scheduler(self.kv, max_seqs, budget)
        self.requests: dict[str, list[Sequence]] = {}
        self.ids = 0
        self.rng = random.Random(0)
        self.preemptions = 0

    def live(self):
        return [s for seqs in self.requests.values() for s in seqs if not s.finished]

    def add(self, prompt_len, max_tokens, prefix_kind, n):
        # a few shared prefixes make prefix-cache hits likely
        prefix = [prefix_kind] * (prompt_len - 3) if prefix_kind else []
        prompt = (prefix + [self.rng.randrange(50) for _ in range(prompt_len)])[:prompt_len]
        if self.kv.blocks_needed(prompt_len + max_tokens) > self.kv.num_blocks:
            return  # the engine rejects such a request up front
        rid = str(self.ids)
        self.ids += 1
        params = SamplingParams(max_tokens=max_tokens, n=n)
        seqs = [Sequence(self.ids * 10 + i, rid, i, list(prompt), prompt_len, params, self.ids) for i in range(n)]
        seqs[0].fork_children = seqs[1:]
        self.requests[rid] = seqs
        self.sched.add(seqs[0])

    def step(self):
        batch = self.sched.schedule()
        assert batch.num_tokens <= self.sched.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs
        self.preemptions += len(batch.preempted)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status == Status.RUNNING and seq not in batch.preempted
            assert n >= 1 and seq.num_computed_tokens + n <= seq.num_tokens
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n
            seq.num_computed_tokens += n
        for seq in batch.seqs:
            if seq.num_computed_tokens == seq.num_tokens and not seq.finished:
                self.sched.fork(seq)
                seq.token_ids.append(self.rng.randrange(50))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.finish(seq, "length")
        self._drop_finished()

    def end(self, index, reason):
        if not self.requests:
            return
        rid = sorted(self.requests)[index % len(self.requests)]
        for seq in self.requests.pop(rid):
            if not seq.finished:
                self.sched.finish(seq, reason)

    def _drop_finished(self):
        for rid in [r for r, seqs in self.requests.items() if all(s.finished for s in seqs)]:
            del self.requests[rid]

    def check(self):
        self.kv.check_invariants(self.live())
        for seq in self.live():
            assert seq.status in (Status.WAITING, Status.RUNNING)
        for seq in self.sched.waiting:
            assert not seq.block_table and seq.num_computed_tokens == 0, "a waiting sequence holds blocks"


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, min_size=15, max_size=60), num_blocks=st.integers(8, 24), budget=st.integers(1, 48),
       max_seqs=st.integers(2, 6), prefix_caching=st.booleans())
def test_random_operations_keep_blocks_consistent(ops, num_blocks, budget, max_seqs, prefix_caching):
    h = Harness(num_blocks, budget, max_seqs, prefix_caching)
    for o in ops:
        if o[0] == "add":
            h.add(*o[1:])
        elif o[0] == "step":
            h.step()
        else:
            h.end(o[1], "abort" if o[0] == "abort" else "stop")
        h.check()
    # whatever is left runs to completion: no deadlock, then nothing is held
    for _ in range(2000):
        if not h.requests:
            break
        h.step()
        h.check()
    assert not h.requests, "requests never finished"
    event(f"preempted: {h.preemptions > 0}")
    event(f"prefix hits: {h.kv.hits > 0}")
    assert all(c == 0 for c in h.kv.ref_cnt)
    assert h.kv.num_free_blocks == h.kv.num_blocks  # every block is free or (evictable) cached

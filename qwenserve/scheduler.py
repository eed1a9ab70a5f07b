"""Continuous batching: every step picks which sequences run and how many tokens each computes.

Running sequences go first (decodes and unfinished prompt chunks, oldest first), then waiting ones are
admitted while the token budget, the sequence limit and the KV blocks allow. A prompt longer than the budget
is split into chunks over several steps. When blocks run out, the newest running sequence is preempted: its
blocks are freed and it is recomputed later from its tokens, so it still produces the same output.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = Status.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq, n):
                victim = self.running.pop()  # the newest; never one already scheduled this step
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, n)
                budget -= n
                i += 1
        if batch.preempted:
            return batch  # no admissions while memory is this tight
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq)
            n = min(seq.num_tokens - len(cached) * self.kv.block_size, budget)
            if not self.kv.allocate(seq, n, cached):
                break
            if seq.num_preemptions == 0:
                self.kv.record_query(seq.num_prompt_tokens)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return batch

    def fork(self, parent: Sequence) -> None:
        """Start parent's sibling samples once its prompt is computed: each shares the prompt's full blocks and
        runs at once (a waiting sequence never holds blocks, or it could starve the running ones). Without a
        free sequence slot a sibling waits like a new request, finding the prompt in the prefix cache if on."""
        for child in parent.fork_children:
            if len(self.running) < self.max_num_seqs:
                self.kv.fork(parent, child)
                child.status = Status.RUNNING
                self.running.append(child)
            else:
                self.add(child)
        parent.fork_children = []

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free_sequence(seq)
        seq.num_preemptions += 1
        self.add(seq, front=True)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Take seq out of scheduling and free its blocks at once."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free_sequence(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

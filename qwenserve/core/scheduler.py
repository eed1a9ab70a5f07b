"""Continuous batching: every step picks which sequences run and how many tokens each computes.

Running sequences go first (decodes and unfinished prompt chunks, oldest first), then waiting ones are
admitted while the token budget, the sequence limit and the KV blocks allow. A prompt longer than the budget
is split into chunks over several steps. When blocks run out, the newest running sequence is preempted: its
blocks are freed and it is recomputed later from its tokens, so it still produces the same output.

The contract with the worker (see core/step.py): `schedule() -> SchedulerOutput` says what to run;
`update_from_output(SchedulerOutput, ModelRunnerOutput)` records what was computed and sampled. Deciding
that a sequence ends (stop tokens, lengths, stop strings) is the engine's; it calls `finish`.
"""
from __future__ import annotations

from collections import deque

from qwenserve.core.kv_cache_manager import KVCacheManager
from qwenserve.core.request import Sequence, Status
from qwenserve.core.step import CachedSequenceData, ModelRunnerOutput, NewSequenceData, SchedulerOutput


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._live: dict[int, Sequence] = {}  # seq id -> every sequence not finished
        # seq id -> how many of its blocks the worker knows; absent: the worker has not seen the sequence
        self._blocks_sent: dict[int, int] = {}
        self._finished_ids: set[int] = set()  # to tell the worker at the next schedule()

    def add(self, seq: Sequence) -> None:
        self._live[seq.seq_id] = seq
        self._wait(seq)

    def _wait(self, seq: Sequence, front: bool = False) -> None:
        seq.status = Status.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq, n):
                victim = self.running.pop()  # the newest; never one already scheduled this step
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self._add_to_batch(out, seq, n)
                budget -= n
                i += 1
        if preempted:
            return out  # no admissions while memory is this tight
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
            self._add_to_batch(out, seq, n)
            budget -= n
        return out

    def _add_to_batch(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        sent = self._blocks_sent.get(seq.seq_id)
        if sent is None:
            out.new_seqs.append(NewSequenceData(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, seq.params,
                                                list(seq.block_table), seq.num_computed_tokens))
        else:
            # 0 blocks sent happens only after a preemption (a scheduled sequence always holds a block)
            out.cached_seqs.append(CachedSequenceData(seq.seq_id, seq.block_table[sent:], seq.num_computed_tokens,
                                                      resumed_from_preemption=sent == 0))
        self._blocks_sent[seq.seq_id] = len(seq.block_table)
        out.num_scheduled_tokens[seq.seq_id] = n

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[Sequence]:
        """Advance each scheduled sequence by the tokens it computed and append what it sampled; start the
        siblings of an n > 1 request once its prompt is done. Returns the scheduled sequences still live."""
        ran = []
        for seq_id, n in scheduler_output.num_scheduled_tokens.items():
            seq = self._live.get(seq_id)
            if seq is not None:  # else ended while its step ran
                seq.num_computed_tokens += n
                ran.append(seq)
        for seq_id, token in zip(runner_output.seq_ids, runner_output.sampled_token_ids):
            seq = self._live.get(seq_id)
            if seq is None:
                continue
            if seq.fork_children:
                self._fork(seq)
            seq.token_ids.append(token)
        return ran

    def _fork(self, parent: Sequence) -> None:
        """Start parent's sibling samples once its prompt is computed: each shares the prompt's full blocks and
        runs at once (a waiting sequence never holds blocks, or it could starve the running ones). Without a
        free sequence slot a sibling waits like a new request, finding the prompt in the prefix cache if on."""
        for child in parent.fork_children:
            self._live[child.seq_id] = child
            if len(self.running) < self.max_num_seqs:
                self.kv.fork(parent, child)
                child.status = Status.RUNNING
                self.running.append(child)
            else:
                self._wait(child)
        parent.fork_children = []

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free_sequence(seq)
        seq.num_preemptions += 1
        if seq.seq_id in self._blocks_sent:
            self._blocks_sent[seq.seq_id] = 0  # the worker keeps its tokens and generator; its blocks are gone
        self._wait(seq, front=True)

    def finish(self, seqs: list[Sequence]) -> None:
        """Take sequences out of scheduling and free their blocks at once (ended, or aborted)."""
        for seq in seqs:
            if seq.status == Status.RUNNING:
                self.running.remove(seq)
            elif seq.status == Status.WAITING and seq in self.waiting:
                self.waiting.remove(seq)
            self.kv.free_sequence(seq)
            seq.status = Status.FINISHED
            self._live.pop(seq.seq_id, None)
            if self._blocks_sent.pop(seq.seq_id, None) is not None:
                self._finished_ids.add(seq.seq_id)

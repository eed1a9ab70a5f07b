"""Continuous batching: every step picks which sequences run and how many tokens each computes.

Running sequences go first (decodes and unfinished prompt chunks, oldest first), then waiting ones are
admitted while the token budget, the sequence limit and the KV blocks allow. A prompt longer than the budget
is split into chunks over several steps. When blocks run out, the newest running sequence is preempted: its
blocks are freed and it is recomputed later from its tokens, so it still produces the same output.

The contract with the worker (see core/step.py): `schedule() -> SchedulerOutput` says what to run;
`update_from_output(SchedulerOutput, ModelRunnerOutput)` records what was computed and sampled. Deciding
that a sequence ends (stop tokens, lengths, stop strings) is the engine's; it calls `finish`.

Under pipeline parallelism the engine keeps up to `max_concurrent_batches` steps in flight (one per stage).
A sequence sits in at most one of them: later schedules skip it until its output is back, never preempt it,
and each batch takes about an equal share of the sequences, so every stage has work.

With speculative decoding (core/speculation.py) a decoding sequence also computes the drafts the worker proposed
for it after its last step (their cache slots allocated like its own token's); it advances by the drafts accepted
only, so a rejected draft's slot is written again by the next step. With a draft model, a sequence asked for
proposals also gets k lookahead slots past its step's tokens, where the draft writes its proposals' K/V. Short of
blocks, drafts and lookahead slots (and with them that step's proposals) go before anyone is preempted for them.
"""
from __future__ import annotations

import math
from collections import Counter, deque

from qwenserve.core.kv_cache_manager import KVCacheManager
from qwenserve.core.request import Sequence, Status
from qwenserve.core.speculation import Speculation
from qwenserve.core.step import CachedSequenceData, ModelRunnerOutput, NewSequenceData, SchedulerOutput

class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_concurrent_batches: int = 1, pipelined_step_tokens: int | None = None,
                 max_loras: int | None = None, speculation: Speculation | None = None):
        """pipelined_step_tokens: with several steps in flight, the most tokens one step takes (SchedulerConfig's;
        a prefill step's first stage runs while the later ones wait for it and its last while the earlier ones
        have nothing more, so smaller steps shorten that fill and drain); None: the whole budget.
        max_loras: the most distinct adapters the running sequences may use (the worker's slots); None: no limit.
        speculation: speculative decoding's policy and counters; None: off."""
        self.kv = kv
        self.num_preemptions = 0  # since start, for the server's metrics
        self.max_loras = max_loras
        self.speculation = speculation
        self._speculating = False  # this schedule() verifies and asks for drafts: speculation on, batch not too large
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_tokens = (max_num_batched_tokens if max_concurrent_batches == 1 or pipelined_step_tokens is None
                            else min(max_num_batched_tokens, pipelined_step_tokens))
        self.max_concurrent_batches = max_concurrent_batches
        self.in_flight: set[int] = set()  # ids of sequences in a scheduled step whose output is not back
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._live: dict[int, Sequence] = {}  # seq id -> every sequence not finished
        # seq id -> how many of its blocks / tokens the worker knows; absent: the worker has not seen the sequence
        self._blocks_sent: dict[int, int] = {}
        self._tokens_sent: dict[int, int] = {}
        self._finished_ids: set[int] = set()  # to tell the worker at the next schedule()

    def add(self, seq: Sequence) -> None:
        self._live[seq.seq_id] = seq
        self._wait(seq)

    def _wait(self, seq: Sequence, front: bool = False) -> None:
        seq.status = Status.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def schedule(self) -> SchedulerOutput:
        # the ended ids go with the next step that runs (an empty one is not sent; see _add_to_batch)
        out = SchedulerOutput(finished_seq_ids=self._finished_ids)
        budget = self.step_tokens
        seats = self._batch_seats()
        memory_tight = False
        # speculation steps aside for large batches (core/speculation.py)
        self._speculating = self.speculation is not None and self.speculation.batch_allows(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0 and seats > 0:
            seq = self.running[i]
            if seq.seq_id in self.in_flight:
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            drafts = self.speculation.drafts_to_verify(seq, budget) if self._speculating else []
            lookahead, may_propose = self._lookahead(seq, n), True
            scheduled = True
            while not self.kv.allocate(seq, n + len(drafts) + lookahead):
                memory_tight = True
                if drafts or lookahead:  # no one is preempted for drafts, nor for the slots of proposals
                    drafts, lookahead, may_propose = [], 0, not lookahead
                    continue
                victim = self._preemption_victim(i)
                if victim is None:  # only newer sequences could give way, and they are in flight: wait for them
                    scheduled = False
                    i += 1
                    break
                self.running.remove(victim)
                self._preempt(victim)
                if victim is seq:
                    scheduled = False
                    break
            if scheduled:
                self._add_to_batch(out, seq, n, drafts, may_propose)
                budget -= n + len(drafts)
                seats -= 1
                i += 1
        if memory_tight:
            return out  # no admissions while memory is this tight
        adapters = (set() if self.max_loras is None  # no adapter slots to count
                    else {seq.lora_int_id for seq in self.running if seq.lora_request is not None})
        passed_over: list[Sequence] = []  # waiting for an adapter slot: they keep their place in the queue
        while self.waiting and budget > 0 and seats > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._adapter_fits(seq, adapters):
                passed_over.append(self.waiting.popleft())
                continue
            cached = self.kv.find_cached_prefix(seq)
            n = min(seq.num_tokens - len(cached) * self.kv.block_size, budget)
            lookahead = self._lookahead(seq, n, len(cached) * self.kv.block_size)
            may_propose = not lookahead or self.kv.allocate(seq, n + lookahead, cached)
            # short of the lookahead: admitted without proposals rather than not at all
            if not (lookahead and may_propose) and not self.kv.allocate(seq, n, cached):
                break
            if seq.num_preemptions == 0:
                self.kv.record_query(seq.num_prompt_tokens)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.lora_request is not None:
                adapters.add(seq.lora_int_id)
            self._add_to_batch(out, seq, n, may_propose=may_propose)
            budget -= n
            seats -= 1
        self.waiting.extendleft(reversed(passed_over))
        return out

    def _adapter_fits(self, seq: Sequence, adapters: set[int]) -> bool:
        """Whether seq may run beside the running sequences, which use `adapters`: a new adapter needs a free slot."""
        return (seq.lora_request is None or self.max_loras is None or seq.lora_int_id in adapters
                or len(adapters) < self.max_loras)

    def _batch_seats(self) -> int:
        """Sequences this step may take: all it can, or with several steps in flight an equal share of the
        live ones, so that the next step has sequences left to run."""
        if self.max_concurrent_batches == 1:
            return self.max_num_seqs
        live = len(self.running) + len(self.waiting)
        return max(1, math.ceil(live / self.max_concurrent_batches))

    def _preemption_victim(self, i: int) -> Sequence | None:
        """The newest running sequence not scheduled this step (those sit before i) nor in flight; running[i]
        itself if it is the newest; None if only newer sequences in flight could give way. Preempting running[i]
        then instead would invert priority: two sequences that cannot fit together would preempt each other in
        turn, each losing its progress, forever (found with two steps in flight)."""
        newer = self.running[i + 1:]
        for seq in reversed(newer):
            if seq.seq_id not in self.in_flight:
                return seq
        return None if newer else self.running[i]

    def _lookahead(self, seq: Sequence, n: int, num_computed: int | None = None) -> int:
        """Slots past its n new tokens that seq takes this step for its proposals (a draft model's K/V): some only
        when it speculates and takes a token this step. num_computed: where its new tokens start (prefix hits)."""
        computed = seq.num_computed_tokens if num_computed is None else num_computed
        if not self._speculating or computed + n != seq.num_tokens:
            return 0
        return self.speculation.lookahead(seq)

    def _add_to_batch(self, out: SchedulerOutput, seq: Sequence, n: int, drafts: list[int] = (),
                      may_propose: bool = True) -> None:
        """may_propose: False when seq's lookahead slots did not fit, so it makes no proposals this step."""
        sent = self._blocks_sent.get(seq.seq_id)
        if sent is None:
            out.new_seqs.append(NewSequenceData(
                seq_id=seq.seq_id, token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
                params=seq.params, block_ids=list(seq.block_table), num_computed_tokens=seq.num_computed_tokens,
                lora_request=seq.lora_request, images=seq.images))
        else:
            # 0 blocks sent happens only after a preemption (a scheduled sequence always holds a block)
            out.cached_seqs.append(CachedSequenceData(
                seq_id=seq.seq_id, new_block_ids=seq.block_table[sent:], num_computed_tokens=seq.num_computed_tokens,
                new_token_ids=seq.token_ids[self._tokens_sent[seq.seq_id]:], resumed_from_preemption=sent == 0))
        self._blocks_sent[seq.seq_id] = len(seq.block_table)
        self._tokens_sent[seq.seq_id] = seq.num_tokens
        out.num_scheduled_tokens[seq.seq_id] = n + len(drafts)
        if drafts:
            out.spec_token_ids[seq.seq_id] = list(drafts)
        if may_propose and self._speculating and seq.num_computed_tokens + n == seq.num_tokens:  # takes a token
            num_to_propose = self.speculation.num_to_propose(seq)
            if num_to_propose:
                out.num_draft_tokens_to_propose[seq.seq_id] = num_to_propose
        self.in_flight.add(seq.seq_id)
        self._finished_ids = set()  # out holds the old set

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[Sequence]:
        """Advance each scheduled sequence by the tokens it computed (its accepted drafts only) and append what it
        sampled; keep the drafts proposed for its next step; start the siblings of an n > 1 request once its prompt
        is done. Returns the scheduled sequences still live."""
        ran = []
        num_taken = Counter(runner_output.seq_ids)
        for seq_id, n in scheduler_output.num_scheduled_tokens.items():
            self.in_flight.discard(seq_id)
            seq = self._live.get(seq_id)
            if seq is not None:  # else ended while its step ran
                drafts = scheduler_output.spec_token_ids.get(seq_id)
                if drafts:
                    n -= self.speculation.record(seq, len(drafts), num_taken[seq_id])
                seq.num_computed_tokens += n
                seq.spec_token_ids = runner_output.draft_token_ids.get(seq_id, [])
                ran.append(seq)
        for seq_id, token in zip(runner_output.seq_ids, runner_output.sampled_token_ids):
            seq = self._live.get(seq_id)
            if seq is None:
                continue
            if seq.fork_children:
                self._fork(seq)
            seq.token_ids.append(token)
        return ran

    def live_in_step(self, scheduler_output: SchedulerOutput) -> list[Sequence]:
        """The step's sequences that have not ended since it was scheduled."""
        return [self._live[i] for i in scheduler_output.num_scheduled_tokens if i in self._live]

    def drop_step(self, scheduler_output: SchedulerOutput) -> list[Sequence]:
        """A step that failed: its sequences are no longer in flight; returns those to be ended: the step's live
        sequences, and any other that adopted a block the step was to write (its prefix hit would read garbage)."""
        for seq_id in scheduler_output.num_scheduled_tokens:
            self.in_flight.discard(seq_id)
        failed = self.live_in_step(scheduler_output)
        unwritten = set()
        for seq in failed:
            unwritten |= self.kv.uncache_unwritten(seq)
        readers = [seq for seq in self._live.values()
                   if seq not in failed and unwritten.intersection(seq.block_table)]
        return failed + readers

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
        seq.spec_token_ids = []  # it prefills again first
        seq.num_preemptions += 1
        self.num_preemptions += 1
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
            self._tokens_sent.pop(seq.seq_id, None)
            if self._blocks_sent.pop(seq.seq_id, None) is not None:
                self._finished_ids.add(seq.seq_id)

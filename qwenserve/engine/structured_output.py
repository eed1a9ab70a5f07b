"""Structured output in the engine: each constrained request waits here until its grammar is compiled (on the
compiler's thread, so the steps of the others go on), then its sequences enter the scheduler, each with a
matcher of its own. Before a step runs, the matchers of the constrained sequences that take a token fill the
step's bitmask (one call for the whole batch); when the step's tokens come back each matcher consumes its
sequence's token. A matcher follows the sequence's tokens, which preemption never takes back (a preempted
sequence is recomputed from them), so recompute cannot corrupt it.

A sequence ends ("stop") as soon as its grammar is complete. A request whose grammar fails to compile, or whose
matcher rejects a token, fails with an error: it never goes on unconstrained."""
from __future__ import annotations

import concurrent.futures

from qwenserve.config.errors import RequestError
from qwenserve.core.request import Sequence
from qwenserve.core.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from qwenserve.sample.grammar import GrammarCompiler
from qwenserve.sample.structured_outputs import FIELD


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._compiling: dict[str, tuple[list[Sequence], concurrent.futures.Future]] = {}  # request id -> ...
        self._matchers: dict[int, object] = {}  # seq id -> its llguidance matcher
        self._seqs: dict[int, Sequence] = {}

    def add(self, request_id: str, seqs: list[Sequence]) -> None:
        """Start compiling a constrained request's grammar (its sequences share it); take_ready hands them back."""
        self._compiling[request_id] = (seqs, self.compiler.compile(seqs[0].params.structured_outputs))

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def take_ready(self) -> tuple[list[list[Sequence]], dict[str, Exception]]:
        """(the sequences of each request whose grammar is now compiled, to schedule; the requests whose grammar
        failed to compile, with the error to fail them with)."""
        ready, failed = [], {}
        for request_id, (seqs, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is not None:
                failed[request_id] = error if isinstance(error, RequestError) else RequestError(
                    f"{FIELD}: the grammar could not be compiled ({type(error).__name__}: {error})", param=FIELD)
                continue
            for seq in seqs:
                self._matchers[seq.seq_id] = self.compiler.new_matcher(future.result())
                self._seqs[seq.seq_id] = seq
            ready.append(seqs)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a grammar being compiled is ready or timeout seconds pass (when nothing else can run)."""
        futures = [future for _, future in self._compiling.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def attach_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Fill the step's bitmask for its constrained sequences that take a token (those whose scheduled
        tokens reach their last known token). Nothing to walk while no constrained sequence is live."""
        if not self._matchers:
            return
        seq_ids = [seq_id for seq_id, n in scheduler_output.num_scheduled_tokens.items()
                   if seq_id in self._matchers
                   and self._seqs[seq_id].num_computed_tokens + n == self._seqs[seq_id].num_tokens]
        if seq_ids:
            bitmask = self.compiler.fill_bitmask([self._matchers[seq_id] for seq_id in seq_ids])
            scheduler_output.grammar_bitmask = GrammarBitmask(seq_ids, bitmask)

    def advance(self, runner_output: ModelRunnerOutput) -> tuple[set[int], dict[int, str]]:
        """Each constrained sequence's matcher consumes the token it took. Returns (the sequences whose grammar
        is now complete, the sequences whose matcher rejected its token or failed, with why)."""
        complete, broken = set(), {}
        if not self._matchers:  # unconstrained serving: nothing to walk
            return complete, broken
        for seq_id, token in zip(runner_output.seq_ids, runner_output.sampled_token_ids):
            matcher = self._matchers.get(seq_id)
            if matcher is None:
                continue
            if not matcher.consume_token(token):
                broken[seq_id] = matcher.get_error() or f"token {token} is not allowed by the grammar"
            elif matcher.is_stopped():
                complete.add(seq_id)
        return complete, broken

    def request_of(self, seq_id: int) -> str:
        return self._seqs[seq_id].request_id

    def release(self, seqs: list[Sequence]) -> None:
        """Forget ended sequences' matchers."""
        if not self._matchers:
            return
        for seq in seqs:
            self._matchers.pop(seq.seq_id, None)
            self._seqs.pop(seq.seq_id, None)

    def abort(self, request_id: str) -> None:
        """Forget a request still compiling (one already running is released with its sequences)."""
        self._compiling.pop(request_id, None)

    def shutdown(self) -> None:
        self.compiler.shutdown()

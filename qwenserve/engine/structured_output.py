"""Structured output in the engine: each constrained request waits here until its grammar is compiled (on the
compiler's thread, so the steps of the others go on), then its sequences enter the scheduler, each with a
matcher of its own. Before a step runs, the matchers of the constrained sequences that take a token fill the
step's bitmask (one call for the whole batch); when the step's tokens come back each matcher consumes its
sequence's token. A matcher follows the sequence's tokens, which preemption never takes back (a preempted
sequence is recomputed from them), so recompute cannot corrupt it.

A constraint with a free prefix (a thinking model's reasoning) starts after it: each of its sequences has a gate
(sample/free_prefix.py) that follows its tokens; while the prefix lasts, the sequence's row is left out of the
bitmask (or, while it is undecided whether the output opens the prefix, the grammar's row is widened by the
tokens that may open it; while the answer after it may still start with blanks, by the blank-only tokens). The
gate, like the matcher, moves only forward with the sequence's tokens, so preemption leaves it as it was;
constrained sequences never speculate (core/speculation.py), so no token is ever taken back; each of n samples
has its own.

A sequence ends ("stop") as soon as its grammar is complete. A request whose grammar fails to compile fails with
an error naming its constraint; one whose matcher rejects a token fails too (the engine's failure: the mask
allowed the token), and never goes on unconstrained."""
from __future__ import annotations

import concurrent.futures

from qwenserve.config.errors import RequestError
from qwenserve.core.request import Sequence
from qwenserve.core.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from qwenserve.sample.free_prefix import CONSTRAINED, FREE, LEADING_BLANKS, UNDECIDED, PrefixGate, PrefixMasks
from qwenserve.sample.grammar import GrammarCompiler
from qwenserve.sample.structured_outputs import FIELD


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        # request id -> (its sequences, their grammar, their free prefix's masks, if they have one)
        self._compiling: dict[str, tuple[list[Sequence], concurrent.futures.Future,
                                         concurrent.futures.Future | None]] = {}
        self._matchers: dict[int, object] = {}  # seq id -> its llguidance matcher
        self._seqs: dict[int, Sequence] = {}
        self._gates: dict[int, PrefixGate] = {}  # seq id -> its gate, for a constraint with a free prefix
        self._masks: dict[int, PrefixMasks] = {}  # seq id -> its gate's masks

    def add(self, request_id: str, seqs: list[Sequence]) -> None:
        """Start compiling a constrained request's grammar (its sequences share it); take_ready hands them back."""
        constraint = seqs[0].params.structured_outputs
        prefix = constraint.free_prefix
        masks = self.compiler.prefix_masks(prefix.start) if prefix is not None else None
        self._compiling[request_id] = (seqs, self.compiler.compile(constraint), masks)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def take_ready(self) -> tuple[list[list[Sequence]], dict[str, Exception]]:
        """(the sequences of each request whose grammar is now compiled, to schedule; the requests whose grammar
        failed to compile, with the error to fail them with)."""
        ready, failed = [], {}
        for request_id, (seqs, future, masks) in list(self._compiling.items()):
            if not future.done() or (masks is not None and not masks.done()):
                continue
            del self._compiling[request_id]
            error = future.exception() or (masks.exception() if masks is not None else None)
            if error is not None:
                failed[request_id] = error if isinstance(error, RequestError) else RequestError(
                    f"{FIELD}: the grammar could not be compiled ({type(error).__name__}: {error})", param=FIELD)
                continue
            prefix = seqs[0].params.structured_outputs.free_prefix
            for seq in seqs:
                self._matchers[seq.seq_id] = self.compiler.new_matcher(future.result())
                self._seqs[seq.seq_id] = seq
                if prefix is not None:
                    self._gates[seq.seq_id] = PrefixGate(prefix)
                    self._masks[seq.seq_id] = masks.result()
            ready.append(seqs)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a grammar being compiled is ready or timeout seconds pass (when nothing else can run)."""
        futures = [f for _, *both in self._compiling.values() for f in both if f is not None and not f.done()]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def attach_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Fill the step's bitmask for its constrained sequences that take a token (those whose scheduled
        tokens reach their last known token). Nothing to walk while no constrained sequence is live."""
        if not self._matchers:
            return
        seq_ids = [seq_id for seq_id, n in scheduler_output.num_scheduled_tokens.items()
                   if seq_id in self._matchers
                   and self._seqs[seq_id].num_computed_tokens + n == self._seqs[seq_id].num_tokens
                   and (seq_id not in self._gates or self._gates[seq_id].phase != FREE)]  # free text: no row
        if seq_ids:
            bitmask = self.compiler.fill_bitmask([self._matchers[seq_id] for seq_id in seq_ids])
            for row, seq_id in enumerate(seq_ids):
                gate = self._gates.get(seq_id)
                if gate is not None and gate.phase == UNDECIDED:  # the answer may still open its free prefix
                    opening = self._masks[seq_id].opening[gate.lead]
                    bitmask[row] = (bitmask[row] | opening) if gate.grammar_alive else opening
                elif gate is not None and gate.phase == LEADING_BLANKS:  # the answer may still start with blanks
                    bitmask[row] |= self._masks[seq_id].blanks
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
            gate = self._gates.get(seq_id)
            if gate is not None and gate.phase != CONSTRAINED:
                why = self._through_gate(gate, matcher, token, self._seqs[seq_id].params.skip_special_tokens)
                if why:
                    broken[seq_id] = why
                elif gate.phase != FREE and gate.grammar_alive and matcher.is_stopped():
                    complete.add(seq_id)
            elif not matcher.consume_token(token):
                broken[seq_id] = matcher.get_error() or f"token {token} is not allowed by the grammar"
            elif matcher.is_stopped():
                complete.add(seq_id)
        return complete, broken

    def _through_gate(self, gate: PrefixGate, matcher, token: int, skip_special_tokens: bool) -> str:
        """A token of a sequence still in (or maybe opening) its free prefix; returns why its grammar cannot go
        on, or "". Undecided, the grammar takes the token where it allows it (validated first, so that a token
        only the opening allowed leaves the matcher as it was). Of the answer's leading blanks the grammar sees
        none: it takes the first token with other text."""
        if gate.phase == LEADING_BLANKS:
            if gate.take_blank(self.compiler.text_bytes(token, skip_special_tokens)) or matcher.consume_token(token):
                return ""
            return matcher.get_error() or f"token {token} is not allowed by the grammar"
        if gate.phase == UNDECIDED:
            if gate.grammar_alive and matcher.validate_tokens([token]) == 1:
                matcher.consume_token(token)
            else:
                gate.grammar_alive = False
        opened, after = gate.feed(self.compiler.text_bytes(token, skip_special_tokens))
        if opened:
            matcher.reset()  # the answer comes after the free text: the grammar starts from its start
        if gate.phase == CONSTRAINED and not opened and after is None and not gate.grammar_alive:
            return f"token {token} is not allowed by the grammar"  # decided as the answer, which the grammar refused
        if after:  # the answer's first bytes came in the token that ended the free text
            if not matcher.consume_tokens(self.compiler.tokenize_bytes(after)):
                return matcher.get_error() or f"{after!r}, written in the token that ended the free text, " \
                                              f"is not allowed by the grammar"
        return ""

    def request_of(self, seq_id: int) -> str:
        return self._seqs[seq_id].request_id

    def release(self, seqs: list[Sequence]) -> None:
        """Forget ended sequences' matchers."""
        if not self._matchers:
            return
        for seq in seqs:
            self._matchers.pop(seq.seq_id, None)
            self._seqs.pop(seq.seq_id, None)
            self._gates.pop(seq.seq_id, None)
            self._masks.pop(seq.seq_id, None)

    def abort(self, request_id: str) -> None:
        """Forget a request still compiling (one already running is released with its sequences)."""
        self._compiling.pop(request_id, None)

    def shutdown(self) -> None:
        self.compiler.shutdown()

"""The scheduler's side of speculative decoding: which sequences the worker proposes drafts for, how many of a
sequence's drafts a step verifies, and what verification accepted (the counters behind the engine's stats).

Speculation steps aside where it cannot pay: no proposals while more than `disable_by_batch_size` sequences run
(verifying k more tokens per sequence stops being nearly free once a step is no longer bound by reading the
weights), and none for a while for a sequence whose drafts are rarely accepted: each verification moves its
acceptance rate (an exponential average) towards the fraction accepted, and below `min_acceptance_rate` it
pauses for PAUSE_STEPS steps, then tries again from the threshold, so that one more poor verification pauses it
again. Constrained sequences (structured output) never speculate: their grammar masks one token a step."""
from __future__ import annotations

from dataclasses import dataclass, field

from qwenserve.core.request import Sequence

ACCEPTANCE_DECAY = 0.5  # weight of the history in a sequence's acceptance rate: three bad verifications in a row
PAUSE_STEPS = 16  # decode steps a sequence of low acceptance goes without proposals


@dataclass
class SpeculationStats:
    num_drafts: int = 0  # verifications (steps in which a sequence brought at least one draft)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # drafts accepted at each position of a verification (the i-th draft is accepted only with all before it)
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average, the target's own one included (as vLLM reports it); 0 before
        any."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculation:
    def __init__(self, num_speculative_tokens: int, max_model_len: int, disable_by_batch_size: int | None = None,
                 min_acceptance_rate: float = 0.0, lookahead_slots: int = 0):
        """lookahead_slots: cache slots past the step's own tokens that a proposing sequence gets with the step: a
        draft model writes its proposals' K/V there (up to k past the target's new token); n-gram proposals
        need none."""
        self.k = num_speculative_tokens
        self.lookahead_slots = lookahead_slots
        self.max_model_len = max_model_len
        self.disable_by_batch_size = disable_by_batch_size
        self.min_acceptance_rate = min_acceptance_rate
        self.stats = SpeculationStats(accepted_per_position=[0] * num_speculative_tokens)

    def batch_allows(self, num_running: int) -> bool:
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    def lookahead(self, seq: Sequence) -> int:
        """The slots past this step's tokens that seq needs, taking a token this step, for the proposals it would
        make (num_to_propose, without counting down its pause)."""
        if seq.params.structured_outputs is not None or seq.spec_pause:
            return 0
        return self.lookahead_slots

    def num_to_propose(self, seq: Sequence) -> int:
        """Drafts the worker proposes for seq once it takes its next token (0: none); called each step seq takes
        one, which counts down a pause."""
        if seq.params.structured_outputs is not None:
            return 0
        if seq.spec_pause:
            seq.spec_pause -= 1
            if not seq.spec_pause:
                seq.spec_acceptance = self.min_acceptance_rate
            return 0
        return self.k

    def drafts_to_verify(self, seq: Sequence, budget: int) -> list[int]:
        """The leading drafts of seq that this step verifies: none unless it is decoding, and no more than its
        max_tokens, the context length and the step's token budget (its own token included) leave room for."""
        drafts = seq.spec_token_ids
        if not drafts or seq.spec_pause or seq.num_tokens - seq.num_computed_tokens != 1:
            return []
        p = seq.params
        room = self.max_model_len - seq.num_tokens  # a verification takes up to len(drafts) + 1 tokens
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - seq.num_output_tokens)
        return drafts[:max(0, min(room, budget) - 1)]

    def record(self, seq: Sequence, num_drafts: int, num_taken: int) -> int:
        """A verification of num_drafts drafts that took num_taken tokens (the accepted drafts and one of the
        target's); returns how many drafts were rejected, whose cache slots the sequence will write again."""
        accepted = max(num_taken - 1, 0)
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += accepted
        for position in range(accepted):
            self.stats.accepted_per_position[position] += 1
        seq.spec_acceptance = (ACCEPTANCE_DECAY * seq.spec_acceptance
                               + (1 - ACCEPTANCE_DECAY) * accepted / num_drafts)
        if seq.spec_acceptance < self.min_acceptance_rate:
            seq.spec_pause = PAUSE_STEPS
        return num_drafts - accepted

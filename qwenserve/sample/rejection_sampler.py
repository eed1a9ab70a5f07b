"""Verification of draft tokens: a speculating sequence brings k drafts and the target model's logits at its
k + 1 positions (after its last known token and after each draft); it takes the drafts the target accepts, in
order, then one token of the target's own. The result has exactly the distribution of sampling one token at a
time without speculation.

Each position's distribution is the one the plain sampler would use there (sampler.py: penalties, min_tokens,
temperature, top-k/p, min-p): the drafts before it are taken as the sequence's own tokens, which they are if
verification gets that far.

Drafts are deterministic guesses (a one-hot draft distribution), for which the rejection rule is: accept draft
x with probability p(x); on rejection sample from p without x, renormalized; after k acceptances sample a bonus
token from p. Drawing t ~ p and accepting x exactly when t == x has the same law: P(accept) = p(x), and a
rejected t is distributed as p(t) / (1 - p(x)) over t != x. That form is the one used here, with the plain
sampler's own draw (one uniform from the sequence's generator per token taken, inverted through the same
cumulative sum): a seeded request then takes the same tokens with or without speculation, and greedy rows simply
compare the draft with the argmax."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qwenserve.sample.logprob import Logprob
from qwenserve.sample.sampler import Sampler, SamplingRow, invert_cdf, uniform


@dataclass(eq=False)
class _Position:
    """One verified position of a speculating sequence, as the sampler reads it: the sequence followed by the
    drafts before this position."""
    seq: SamplingRow
    drafts: list[int]

    @property
    def params(self):
        return self.seq.params

    @property
    def generator(self):
        return self.seq.generator

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:  # read only for penalties: built on demand
        return self.seq.token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)


@dataclass
class VerifiedTokens:
    """Per sequence: the drafts it accepted, then one token of the target's own."""
    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob] | None]]  # per token taken, when the request asked for logprobs
    rows: list[list[int]]  # per token taken, the logits row it came from


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow], drafts: list[list[int]],
                 grammar: tuple[torch.Tensor, torch.Tensor] | None = None) -> VerifiedTokens:
        """logits: [sum(len(d) + 1 for d in drafts), V], each sequence's k + 1 positions in order, sequences in
        the order of seqs. grammar: as the plain sampler takes it, its rows counted in these positions (a
        constrained sequence brings no drafts)."""
        positions = [_Position(seq, draft[:j]) if j else seq
                     for seq, draft in zip(seqs, drafts) for j in range(len(draft) + 1)]
        target, raw_logprobs = self.sampler.target_logits(logits, positions, grammar)
        argmax = self.sampler.argmax(target).tolist()
        random_rows = [i for i, p in enumerate(positions) if not p.params.greedy]
        cdf_row = {row: i for i, row in enumerate(random_rows)}
        cdf = (self.sampler.probs(target[random_rows], [positions[i] for i in random_rows]).cumsum(dim=1)
               if random_rows else None)

        out = VerifiedTokens([], [], [])
        first = 0
        for seq, draft in zip(seqs, drafts):
            taken, rows = [], []
            for j in range(len(draft) + 1):
                row = first + j
                if seq.params.greedy:
                    token = argmax[row]
                else:
                    token = int(invert_cdf(cdf[cdf_row[row]:cdf_row[row] + 1], uniform(seq.generator).unsqueeze(1)))
                taken.append(token)
                rows.append(row)
                if j == len(draft) or token != draft[j]:
                    break
            out.token_ids.append(taken)
            out.rows.append(rows)
            first += len(draft) + 1

        flat_rows = [row for rows in out.rows for row in rows]
        flat_tokens = torch.tensor([t for taken in out.token_ids for t in taken], dtype=torch.long)
        logprobs = self.sampler.logprobs(None if raw_logprobs is None else raw_logprobs[flat_rows], flat_tokens,
                                         [positions[row] for row in flat_rows])
        for taken in out.token_ids:
            out.logprobs.append(logprobs[:len(taken)])
            logprobs = logprobs[len(taken):]
        return out

"""Logits -> next tokens for a batch of sequences, each with its own sampling parameters, plus the logprobs a
request asked for. Runs in the worker: only these small results leave it.

Work is done on the whole batch where possible (penalties, temperature, top-k/top-p/min-p masks, greedy);
only drawing a sample from a seeded request's own generator is per row, so that a seeded request gets the
same tokens whatever else shares its batch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qwenserve.kernels import cpu_ops_for
from qwenserve.sample.logits_processors import (
    NEG_INF,
    apply_penalties,
    apply_token_bitmask,
    ban_stop_tokens_before_min_tokens,
)
from qwenserve.sample.logprob import Logprob
from qwenserve.sample.logprobs import top_logprobs
from qwenserve.sample.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the sampler reads of one sequence (the worker's per-sequence state)."""
    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int: ...


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # per row, when the request asked for logprobs


def _plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and row.num_output_tokens >= p.min_tokens)


class Sampler:
    def __init__(self, device: torch.device | str):
        ops = cpu_ops_for(device)
        if ops is not None:
            self.argmax = lambda logits: ops.argmax_rows(logits.contiguous())
        else:
            # max().indices: the same index as argmax, about 4x faster on CPU for [32, 152k] bf16
            self.argmax = lambda logits: logits.max(dim=-1).indices

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 grammar: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplerOutput:
        """logits: [B, V] in the model's dtype, one row per sequence that takes a token this step. grammar: (the
        constrained rows, their token bitmask), applied to those rows at once before a token is chosen."""
        target, raw_logprobs = self.target_logits(logits, rows, grammar)
        tokens = self.argmax(target)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            probs = self.probs(target[random_rows], [rows[i] for i in random_rows])
            tokens[random_rows] = _draw(probs, [rows[i].generator for i in random_rows])
        return SamplerOutput(tokens.tolist(), self.logprobs(raw_logprobs, tokens, rows))

    def target_logits(self, logits: torch.Tensor, rows: list[SamplingRow],
                      grammar: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the logits a token is chosen from, after penalties, grammar masks and min_tokens bans: greedy rows take
        their argmax, the others sample from `probs` of them; the raw logprobs, where a row asked for logprobs).
        With nothing to apply (the common case) the logits come back as they are, uncopied."""
        if grammar is None and all(_plain_greedy(r) for r in rows):
            return logits, None
        # a float copy of our own: the grammar mask writes in place, and the caller may keep its logits
        logits = logits.clone() if grammar is not None and logits.dtype == torch.float32 else logits.float()
        raw_logprobs = (torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows)
                        else None)
        logits = apply_penalties(logits, rows)
        if grammar is not None:
            apply_token_bitmask(logits, *grammar)
        banned = ban_stop_tokens_before_min_tokens(logits, rows)
        if grammar is not None and banned is not logits:
            # where the grammar allows only stop tokens, it wins over min_tokens: it can produce nothing else
            stuck = grammar[0][banned[grammar[0]].amax(dim=1) == NEG_INF]
            banned[stuck] = logits[stuck]
        return banned, raw_logprobs

    def logprobs(self, raw_logprobs: torch.Tensor | None, tokens: torch.Tensor,
                 rows: list[SamplingRow]) -> list[dict[int, Logprob] | None]:
        """Per row, the entry of its chosen token and its top alternatives, if its request asked for them.
        raw_logprobs and tokens: one row per entry of rows."""
        result: list[dict[int, Logprob] | None] = [None] * len(rows)
        if raw_logprobs is None:
            return result
        params = [r.params for r in rows]
        chosen_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        k = max(params[i].logprobs for i in chosen_rows)
        entries = top_logprobs(raw_logprobs[chosen_rows], tokens[chosen_rows], k)
        for i, entry in zip(chosen_rows, entries):
            keep = sorted(entry.values(), key=lambda lp: lp.rank)[:params[i].logprobs]
            chosen = entry[int(tokens[i])]
            result[i] = {lp.token_id: lp for lp in keep} | {chosen.token_id: chosen}
        return result

    def probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each non-greedy row samples from ([R, V], a row's mass need not be 1): temperature,
        then top-k, top-p and min-p. logits: target_logits' rows of those rows."""
        params = [r.params for r in rows]
        x = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else x.shape[1] for p in params])
        if (top_k < x.shape[1]).any():
            kth = x.topk(int(top_k.max()), dim=1).values.gather(1, (top_k - 1).clamp(max=x.shape[1] - 1).unsqueeze(1))
            x = x.masked_fill(x < kth, NEG_INF)
        top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype)
        if (top_p < 1).any():
            sorted_x, order = x.sort(dim=1, descending=True)
            probs = sorted_x.softmax(dim=1)
            mass_before = probs.cumsum(dim=1) - probs  # keep a token while the mass above it is < top_p
            drop = mass_before >= top_p.unsqueeze(1)
            x = x.scatter(1, order, sorted_x.masked_fill(drop, NEG_INF))
        probs = x.softmax(dim=1)
        min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype)
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=1, keepdim=True).values, 0.0)
        return probs


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs ([R, V], each row's mass need not be 1), by inverting its cumulative sum at a
    uniform draw from the row's own generator (the global one where None). torch.multinomial draws through an
    exponential per vocabulary entry: 5 ms a row at V = 152k on this CPU, against 0.2 ms for this."""
    u = torch.cat([uniform(g) for g in generators]).unsqueeze(1)
    return invert_cdf(probs.cumsum(dim=1), u)


def uniform(generator: torch.Generator | None) -> torch.Tensor:
    """The one draw a sampled token takes from its sequence's generator ([1])."""
    return torch.rand(1, generator=generator)


def invert_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row of cdf ([R, V], cumulative sums of unnormalized probabilities) at its uniform draw
    u ([R, 1])."""
    total = cdf[:, -1:].contiguous()  # searchsorted warns about (and copies) a strided value tensor
    picked = torch.searchsorted(cdf, u * total, right=True)  # first entry whose cdf exceeds the draw: its p > 0
    # u * total can round up to total itself: take the last entry with mass, never one past the end
    return torch.minimum(picked, torch.searchsorted(cdf, total)).squeeze(1)

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
            self._argmax = lambda logits: ops.argmax_rows(logits.contiguous())
        else:
            # max().indices: the same index as argmax, about 4x faster on CPU for [32, 152k] bf16
            self._argmax = lambda logits: logits.max(dim=-1).indices

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 grammar: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplerOutput:
        """logits: [B, V] in the model's dtype, one row per sequence that takes a token this step. grammar: (the
        constrained rows, their token bitmask), applied to those rows at once before a token is chosen."""
        if grammar is None and all(_plain_greedy(r) for r in rows):  # the common case: argmax on the raw logits
            return SamplerOutput(self._argmax(logits).tolist(), [None] * len(rows))
        # a float copy of our own: the grammar mask writes in place, and the caller may keep its logits
        logits = logits.clone() if grammar is not None and logits.dtype == torch.float32 else logits.float()
        params = [r.params for r in rows]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = apply_penalties(logits, rows)
        if grammar is not None:
            apply_token_bitmask(logits, *grammar)
        banned = ban_stop_tokens_before_min_tokens(logits, rows)
        if grammar is not None and banned is not logits:
            # where the grammar allows only stop tokens, it wins over min_tokens: it can produce nothing else
            stuck = grammar[0][banned[grammar[0]].amax(dim=1) == NEG_INF]
            banned[stuck] = logits[stuck]
        tokens = self._choose(banned, rows)

        result = SamplerOutput(tokens.tolist(), [None] * len(rows))
        if raw_logprobs is not None:
            chosen_rows = [i for i, w in enumerate(want_logprobs) if w]
            k = max(params[i].logprobs for i in chosen_rows)
            entries = top_logprobs(raw_logprobs[chosen_rows], tokens[chosen_rows], k)
            for i, entry in zip(chosen_rows, entries):
                keep = sorted(entry.values(), key=lambda lp: lp.rank)[:params[i].logprobs]
                chosen = entry[result.token_ids[i]]
                result.logprobs[i] = {lp.token_id: lp for lp in keep} | {chosen.token_id: chosen}
        return result

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        tokens = self._argmax(logits)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return tokens
        params = [rows[i].params for i in random_rows]
        x = logits[random_rows] / torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
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
        tokens[random_rows] = _draw(probs, [rows[i].generator for i in random_rows])
        return tokens


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs ([R, V], each row's mass need not be 1), by inverting its cumulative sum at a
    uniform draw from the row's own generator (the global one where None). torch.multinomial draws through an
    exponential per vocabulary entry: 5 ms a row at V = 152k on this CPU, against 0.2 ms for this."""
    cdf = probs.cumsum(dim=1)
    total = cdf[:, -1:].contiguous()  # searchsorted warns about (and copies) a strided value tensor
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).unsqueeze(1)
    picked = torch.searchsorted(cdf, u * total, right=True)  # first entry whose cdf exceeds the draw: its p > 0
    # u * total can round up to total itself: take the last entry with mass, never one past the end
    return torch.minimum(picked, torch.searchsorted(cdf, total)).squeeze(1)

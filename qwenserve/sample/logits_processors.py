"""Per-request changes to a batch's logits before a token is chosen: penalties on tokens already seen, and bans
(stop tokens before min_tokens). Each returns the logits unchanged, and uncopied, when no row needs it.
Grammar masks for structured output will go here too."""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, rows) -> torch.Tensor:
    """Repetition penalty (vLLM / HF: divides positive logits, multiplies negative ones, for tokens seen in the
    prompt or the output) and OpenAI's presence and frequency penalties (output tokens only)."""
    todo = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
            or r.params.presence_penalty or r.params.frequency_penalty]
    if not todo:
        return logits
    logits = logits.clone()
    v = logits.shape[1]
    for i in todo:
        p, row_state = rows[i].params, rows[i]
        out = torch.tensor(row_state.token_ids[row_state.num_prompt_tokens:], dtype=torch.long)
        counts = torch.bincount(out, minlength=v)[:v].to(logits.dtype)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(row_state.token_ids[:row_state.num_prompt_tokens], dtype=torch.long)] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, penalized, row)
        if p.frequency_penalty or p.presence_penalty:
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
        logits[i] = row
    return logits


def ban_stop_tokens_before_min_tokens(logits: torch.Tensor, rows) -> torch.Tensor:
    todo = [i for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens]
    if not todo:
        return logits
    logits = logits.clone()
    for i in todo:
        p = rows[i].params
        ids = [t for t in set(p.stop_token_ids) | set(p.eos_token_ids) if t < logits.shape[1]]
        if ids:
            logits[i, ids] = NEG_INF
    return logits

"""Top-k logprob extraction for a batch: each row's chosen token and its k most likely tokens as Logprob records."""
from __future__ import annotations

import torch

from qwenserve.sample.logprob import Logprob


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[dict[int, Logprob]]:
    """Per row: the chosen token's logprob and rank, plus the k most likely tokens. logprobs: [B, V]."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(1) + 1
    top_vals, top_ids = logprobs.topk(k, dim=1) if k > 0 else (None, None)
    rows = []
    for i in range(logprobs.shape[0]):
        entry = {}
        if k > 0:
            for r, (tid, lp) in enumerate(zip(top_ids[i].tolist(), top_vals[i].tolist()), 1):
                entry[tid] = Logprob(tid, lp, r)
        c = int(chosen[i])
        entry[c] = Logprob(c, float(chosen_lp[i]), int(ranks[i]))
        rows.append(entry)
    return rows

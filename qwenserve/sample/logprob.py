"""The Logprob record: a token's log-probability and rank, as returned to the request that asked for it. Plain
data (no torch), so the scheduler's step types can carry it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token

"""One sequence being generated: its tokens, where its KV lives, and how far it has got."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # admission order, for preemption (newest first)
    cache_salt: bytes = b""  # extra key in block hashes (e.g. an adapter id), empty for now
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # blocks of block_table entered in the prefix cache
    generator: torch.Generator | None = None  # per-request RNG when seeded
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_preemptions: int = 0
    fork_children: list["Sequence"] = field(default_factory=list)  # siblings waiting for this prompt's blocks
    recorded_logits: list[torch.Tensor] = field(default_factory=list)  # with EngineConfig.record_logits

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

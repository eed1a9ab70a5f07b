"""One sequence being generated, as the scheduler sees it: its tokens, where its KV lives, how far it has got
and why it ended. Text, logprobs and timing belong to the engine's output processor; sampling state (the
seeded generator, token counts for penalties) to the worker."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from qwenserve.core.multimodal import ImageInput
from qwenserve.lora.request import LoRARequest
from qwenserve.sample.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model
    cache_salt: bytes = b""  # extra key in block hashes: the adapter's, so no block serves another adapter
    images: tuple[ImageInput, ...] = ()  # the prompt's images, in order: their hashes key the blocks they touch
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # blocks of block_table entered in the prefix cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    fork_children: list[Sequence] = field(default_factory=list)  # siblings waiting for this prompt's blocks
    # speculative decoding (core/speculation.py): the worker's guesses of the next tokens, verified next step
    spec_token_ids: list[int] = field(default_factory=list)
    spec_acceptance: float = 1.0  # recent fraction of its drafts accepted
    spec_pause: int = 0  # steps left without proposals, after its drafts were rarely accepted

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

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

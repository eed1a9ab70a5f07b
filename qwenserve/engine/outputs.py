"""What generation returns, shaped as vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

from qwenserve.lora.request import LoRARequest
from qwenserve.sample.logprob import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text_delta: str = ""  # text added since the previous output of this request (for streaming)
    token_ids_delta: list[int] = field(default_factory=list)
    logits: list | None = None  # per generated token, only with EngineConfig.record_logits (float32 [vocab])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    last_token_time: float | None = None
    # the gaps between the steps that gave the request tokens after its first (one a step, as vLLM counts them)
    inter_token_latencies: list[float] = field(default_factory=list)
    max_tokens: int = 0  # the request's resolved max_tokens and n, for the server's parameter histograms
    n: int = 1
    engine_index: int = 0  # the data-parallel replica that ran it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    lora_request: LoRARequest | None = None  # the adapter it ran with; None: the base model

"""The typed contract of one engine step, in vLLM v1's shape: the scheduler says what to run
(`SchedulerOutput`), the worker runs it and says what it sampled (`ModelRunnerOutput`).

Both are plain data (ints, lists, sampling parameters, a new sequence's image pixels as numpy arrays; no tensors,
no Sequence objects), so the boundary can become a process boundary: the worker keeps its own per-sequence state,
created by `NewSequenceData` the first time it sees a sequence, advanced by `CachedSequenceData` each later step,
dropped by `finished_seq_ids`.
Only sampled token ids and the logprobs a request asked for come back; never full-vocabulary logits (except
the opt-in `record_logits` debugging channel that `compare` uses).
`ModelRunnerOutput` is declared here, beside its counterpart, because the scheduler consumes it and core may
not import the worker."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qwenserve.core.multimodal import ImageInput
from qwenserve.lora.request import LoRARequest
from qwenserve.sample.logprob import Logprob
from qwenserve.sample.sampling_params import SamplingParams


@dataclass
class NewSequenceData:
    """A sequence the worker has not seen: a new request's first sample, or a forked sibling."""
    seq_id: int
    token_ids: list[int]  # the prompt (and any output so far)
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the cache (prefix hits, blocks shared with a sibling)
    lora_request: LoRARequest | None = None  # the adapter it runs with (the worker loads it); None: the base model
    images: tuple[ImageInput, ...] = ()  # the prompt's images with their pixels (core/multimodal.py says why here)


@dataclass
class CachedSequenceData:
    """A sequence the worker already holds (its tokens and its generator)."""
    seq_id: int
    new_block_ids: list[int]  # appended to its block table; after a preemption, the whole new table
    num_computed_tokens: int
    # tokens sampled since the worker last saw the sequence: every worker learns them from here, because under
    # pipeline parallelism only the last stage samples
    new_token_ids: list[int] = field(default_factory=list)
    resumed_from_preemption: bool = False  # its old blocks are gone: new_block_ids replace the table


@dataclass
class GrammarBitmask:
    """The next-token masks of this step's constrained sequences that take a token (the engine's grammar
    matchers fill it once the batch is known): row i belongs to seq_ids[i], one bit per vocabulary entry,
    little-endian within each 32-bit word, 1 = allowed."""
    seq_ids: list[int]
    bitmask: Any  # numpy int32 array [len(seq_ids), ceil(vocab / 32)]


@dataclass
class SchedulerOutput:
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    cached_seqs: list[CachedSequenceData] = field(default_factory=list)
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)  # seq id -> tokens, in batch order
    finished_seq_ids: set[int] = field(default_factory=set)  # ended since the last step: the worker forgets them
    grammar_bitmask: GrammarBitmask | None = None  # None: no sequence that samples this step is constrained
    # speculative decoding: seq id -> the draft tokens this step verifies, the last len() of its scheduled tokens
    # (they are not the sequence's tokens yet); and seq id -> how many drafts the worker proposes for it once it
    # takes this step's tokens (absent: none)
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    num_draft_tokens_to_propose: dict[int, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    # one row per token taken, in batch order: each sequence that reached its last known token took a new one; one
    # that verified drafts took the drafts accepted and then one more, in consecutive rows
    seq_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)  # per sampled row, if asked for
    # seq id -> (position of the first entry's token, entries for the prompt tokens this step's chunk predicted),
    # for requests that asked for prompt_logprobs
    prompt_logprobs: dict[int, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    logits: list | None = None  # per sampled row, float32 [vocab]: only with EngineConfig.record_logits
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)  # seq id -> drafts for its next step
    # lora_int_id -> why the adapter could not be loaded: its sequences' rows ran without it, and the engine fails
    # their requests (their tokens are not theirs)
    failed_loras: dict[int, str] = field(default_factory=dict)

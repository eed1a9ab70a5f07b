"""The engine: requests in, token outputs out. Each step schedules a batch, runs the model once, samples,
and turns new tokens into text, stopping sequences as their parameters say."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from .cpu_tuning import keep_large_allocations_in_heap
from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .engine_config import EngineConfig
from .kv_cache_manager import KVCacheManager
from .model_loader import LoadedModel
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .paged_attention import PagedKVCache
from .sampler import Sampler, top_logprobs
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    text: str = ""
    emitted_text: int = 0
    emitted_tokens: int = 0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    text: list[_TextState]
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        if torch.device(config.device).type == "cpu":
            keep_large_allocations_in_heap()
        self.loaded = loaded or LoadedModel(config.model, config.dtype, config.max_model_len, config.device)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = self.loaded.max_model_len
        model = self.loaded.model
        attn = model.model.layers[0].self_attn
        n_layers = self.loaded.config.num_hidden_layers
        per_block = PagedKVCache.bytes_per_block(n_layers, config.block_size, attn.num_kv_heads, attn.head_dim,
                                                 self.loaded.dtype)
        num_blocks = config.kv_cache_memory // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {config.kv_cache_memory} bytes is less than one KV block "
                             f"({per_block} bytes for {config.block_size} tokens)")
        logger.info("KV cache: %d blocks of %d tokens = %d tokens max, %.2f GiB (%s)", num_blocks,
                    config.block_size, num_blocks * config.block_size, num_blocks * per_block / (1 << 30),
                    str(self.loaded.dtype).removeprefix("torch."))
        self.cache = PagedKVCache(n_layers, num_blocks, config.block_size, attn.num_kv_heads, attn.head_dim,
                                  self.loaded.dtype, config.device)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache, config.device)
        self.sampler = Sampler(self.loaded.config.vocab_size)
        self.eos_token_ids = frozenset(self.loaded.stop_token_ids())
        self.requests: dict[str, _Request] = {}
        self.num_aborted = 0  # requests stopped before their end (client gone, or an explicit abort)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    # ---- requests -------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        self._check_prompt(ids, params)
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        params = dataclasses.replace(params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids)
        arrival = next(self._arrivals)
        seqs = []
        for i in range(params.n):
            p = params.child(i) if params.n > 1 else params
            gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            seqs.append(Sequence(next(self._seq_ids), request_id, i, list(ids), len(ids), p, arrival, generator=gen))
            if p.prompt_logprobs is not None:
                seqs[-1].prompt_logprobs = [None]
        seqs[0].fork_children = seqs[1:]  # siblings start from the first one's prompt blocks
        states = [_TextState(IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                             StopStringMatcher(params.stop)) for _ in seqs]
        self.requests[request_id] = _Request(request_id, text, ids, params, seqs, states,
                                             RequestMetrics(arrival_time or time.time()))
        self.scheduler.add(seqs[0])

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        max_tokens = params.max_tokens or 1
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt too long: {len(ids)} prompt tokens + {max_tokens} max_tokens = "
                             f"{len(ids) + max_tokens} exceeds max_model_len {self.max_model_len}")
        need = self.kv.blocks_needed(len(ids) + (params.max_tokens or self.max_model_len - len(ids)))
        if need > self.kv.num_blocks:
            raise ValueError(f"prompt too long for the KV cache: {len(ids)} prompt tokens + max_tokens need {need} "
                             f"blocks, the cache has {self.kv.num_blocks} (raise kv_cache_memory)")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once. Returns its final output, or None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.num_aborted += 1
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        req.metrics.finished_time = time.time()
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        out = self.runner.execute(batch)
        sample = self.sampler(out.logits, out.sampling_seqs) if out.sampling_seqs else None
        now = time.time()
        touched: dict[str, _Request] = {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            req = touched[seq.request_id] = self.requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        for seq, logits, first_pos in out.prompt_logits:
            self._record_prompt_logprobs(seq, logits, first_pos)
        for i, seq in enumerate(out.sampling_seqs):
            if seq.fork_children:
                self.scheduler.fork(seq)
            if self.config.record_logits:
                seq.recorded_logits.append(out.logits[i].float())
            self._append_token(seq, sample.token_ids[i], sample.logprobs[i], sample.sampled_logprob[i], now)
        outputs = [self._output(req) for req in touched.values()]
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
        return outputs

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, first_pos: int) -> None:
        """logits[i] predicts the token at first_pos + i + 1."""
        targets = seq.token_ids[first_pos + 1:first_pos + 1 + logits.shape[0]]
        if not targets:
            return
        lp = torch.log_softmax(logits[:len(targets)], dim=-1)
        seq.prompt_logprobs.extend(top_logprobs(lp, torch.tensor(targets), seq.params.prompt_logprobs))

    def _append_token(self, seq: Sequence, token: int, logprobs, sampled_logprob, now: float) -> None:
        req = self.requests[seq.request_id]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
            seq.cumulative_logprob += sampled_logprob
        state = req.text[seq.index]
        delta = state.detokenizer.add(token)
        state.text += delta
        p = seq.params
        may_stop = seq.num_output_tokens >= p.min_tokens
        if may_stop and not p.ignore_eos and token in p.eos_token_ids:
            self.scheduler.finish(seq, "stop")
        elif may_stop and token in p.stop_token_ids:
            self.scheduler.finish(seq, "stop", token)
        elif may_stop and p.stop and (hit := state.stops.find(state.text, len(state.text) - len(delta))):
            index, stop = hit
            state.text = state.text[:index + len(stop) if p.include_stop_str_in_output else index]
            self.scheduler.finish(seq, "stop", stop)
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, "length")

    def _output(self, req: _Request) -> RequestOutput:
        completions = []
        for seq, state in zip(req.seqs, req.text):
            visible = state.text if seq.finished else state.text[:state.stops.safe_len(state.text)]
            outputs = seq.output_token_ids
            completions.append(CompletionOutput(
                index=seq.index, text=visible, token_ids=list(outputs),
                cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                text_delta=visible[state.emitted_text:], token_ids_delta=outputs[state.emitted_tokens:],
                logits=list(seq.recorded_logits) if self.config.record_logits else None))
            state.emitted_text, state.emitted_tokens = max(state.emitted_text, len(visible)), len(outputs)
        first = req.seqs[0]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, first.prompt_logprobs, completions,
                             req.finished, first.num_cached_tokens, req.metrics)

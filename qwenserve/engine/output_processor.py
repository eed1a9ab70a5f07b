"""Outputs: each sampled token becomes text (incremental detokenization), logprobs are collected, and the
engine's stopping rules are applied (EOS, stop token ids, stop strings, max_tokens, the context length); then
one RequestOutput per request that ran this step. Sequences it ends go back to the engine, which frees them."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from qwenserve.core.request import Sequence
from qwenserve.core.step import ModelRunnerOutput
from qwenserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from qwenserve.engine.input_processor import ProcessedRequest
from qwenserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qwenserve.sample.logprob import Logprob


@dataclass
class SampleState:
    """One of a request's n samples, as the client sees it."""
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    text: str = ""
    emitted_text: int = 0
    emitted_tokens: int = 0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logits: list = field(default_factory=list)  # with record_logits

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    request: ProcessedRequest
    seqs: list[Sequence]
    samples: list[SampleState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # the first prompt token has none

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int, record_logits: bool = False):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.record_logits = record_logits
        self.requests: dict[str, RequestState] = {}
        self._seqs: dict[int, Sequence] = {}

    def add_request(self, request_id: str, request: ProcessedRequest, seqs: list[Sequence],
                    arrival_time: float) -> None:
        params = request.params
        samples = [SampleState(IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                      params.skip_special_tokens), StopStringMatcher(params.stop))
                   for _ in seqs]
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        metrics = RequestMetrics(arrival_time, max_tokens=params.max_tokens or 0, n=params.n)
        self.requests[request_id] = RequestState(request_id, request, seqs, samples, metrics, prompt_logprobs)
        self._seqs.update((seq.seq_id, seq) for seq in seqs)

    def process(self, ran: list[Sequence], runner_output: ModelRunnerOutput, grammar_complete: set[int] = frozenset()
                ) -> tuple[list[RequestOutput], list[Sequence]]:
        """The outputs of every request that ran this step, and the sequences that ended. grammar_complete: the
        constrained sequences whose grammar accepts nothing more (they end with "stop")."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        for seq in ran:
            req = touched[seq.request_id] = self.requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        for seq_id, (position, entries) in runner_output.prompt_logprobs.items():
            seq = self._seqs[seq_id]
            lps = self.requests[seq.request_id].prompt_logprobs
            if seq.index == 0 and position <= len(lps):  # a recomputed chunk (after preemption) adds nothing new
                lps.extend(entries[len(lps) - position:])
        finished = []
        rows: dict[int, list[int]] = {}  # seq id -> its rows: several where it verified drafts
        for i, seq_id in enumerate(runner_output.seq_ids):
            rows.setdefault(seq_id, []).append(i)
        for seq_id, seq_rows in rows.items():
            seq = self._seqs[seq_id]
            before = seq.num_output_tokens - len(seq_rows)  # the scheduler has appended all of them
            for j, i in enumerate(seq_rows):
                logits = runner_output.logits[i] if runner_output.logits is not None else None
                if self._add_token(seq, before + j + 1, runner_output.sampled_token_ids[i], runner_output.logprobs[i],
                                   logits, now, seq_id in grammar_complete):
                    # accepted drafts past a stop or a length limit are not output
                    del seq.token_ids[seq.num_tokens - (len(seq_rows) - j - 1):]
                    finished.append(seq)
                    break
        for request_id in {self._seqs[seq_id].request_id for seq_id in rows}:
            self._time_tokens(touched[request_id].metrics, now)
        outputs = [self._output(req) for req in touched.values()]
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                self._forget(req)
        return outputs, finished

    @staticmethod
    def _time_tokens(metrics: RequestMetrics, now: float) -> None:
        """A step that gave the request tokens after its first adds one inter-token gap."""
        if metrics.last_token_time is not None:
            metrics.inter_token_latencies.append(now - metrics.last_token_time)
        metrics.last_token_time = now

    def _add_token(self, seq: Sequence, num_output_tokens: int, token: int, logprobs: dict[int, Logprob] | None,
                   logits, now: float, grammar_complete: bool = False) -> bool:
        """Record seq's new token, its num_output_tokens-th (already appended to seq.token_ids, maybe with more
        after it); True if it ends the sequence."""
        req = self.requests[seq.request_id]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        sample = req.samples[seq.index]
        if logprobs is not None:
            sample.logprobs.append(logprobs)
            sample.cumulative_logprob += logprobs[token].logprob
        if logits is not None and self.record_logits:
            sample.logits.append(logits)
        delta = sample.detokenizer.add(token)
        sample.text += delta
        p = seq.params
        may_stop = num_output_tokens >= p.min_tokens
        if may_stop and not p.ignore_eos and token in p.eos_token_ids:
            sample.finish_reason = "stop"
        elif may_stop and token in p.stop_token_ids:
            sample.finish_reason, sample.stop_reason = "stop", token
        elif may_stop and p.stop and (hit := sample.stops.find(sample.text, len(sample.text) - len(delta))):
            index, stop = hit
            sample.text = sample.text[:index + len(stop) if p.include_stop_str_in_output else index]
            sample.finish_reason, sample.stop_reason = "stop", stop
        elif grammar_complete:  # the grammar allows nothing more (min_tokens cannot make it)
            sample.finish_reason = "stop"
        elif num_output_tokens >= p.max_tokens or seq.num_prompt_tokens + num_output_tokens >= self.max_model_len:
            sample.finish_reason = "length"
        return sample.finished

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[Sequence]]:
        """End a request now: its final output (None if unknown) and its sequences still to free."""
        req = self.requests.get(request_id)
        if req is None:
            return None, []
        live = [seq for seq, sample in zip(req.seqs, req.samples) if not sample.finished]
        for sample in req.samples:
            if not sample.finished:
                sample.finish_reason = "abort"
        req.metrics.finished_time = time.time()
        self._forget(req)
        return self._output(req), live

    def _forget(self, req: RequestState) -> None:
        del self.requests[req.request_id]
        for seq in req.seqs:
            self._seqs.pop(seq.seq_id, None)

    def _output(self, req: RequestState) -> RequestOutput:
        completions = []
        for seq, sample in zip(req.seqs, req.samples):
            visible = sample.text if sample.finished else sample.text[:sample.stops.safe_len(sample.text)]
            outputs = seq.output_token_ids
            wants_logprobs = seq.params.logprobs is not None
            completions.append(CompletionOutput(
                index=seq.index, text=visible, token_ids=list(outputs),
                cumulative_logprob=sample.cumulative_logprob if wants_logprobs else None,
                logprobs=list(sample.logprobs) if wants_logprobs else None,
                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                text_delta=visible[sample.emitted_text:], token_ids_delta=outputs[sample.emitted_tokens:],
                logits=list(sample.logits) if self.record_logits else None))
            sample.emitted_text, sample.emitted_tokens = max(sample.emitted_text, len(visible)), len(outputs)
        request = req.request
        return RequestOutput(req.request_id, request.prompt, request.prompt_token_ids, req.prompt_logprobs,
                             completions, req.finished, req.seqs[0].num_cached_tokens, req.metrics,
                             request.lora_request)

"""The engine: requests in, outputs out. Each step the scheduler picks a batch, the grammar matchers of its
constrained sequences fill their token masks, the executor runs it (model and sampler, in the worker), the
scheduler records what was computed, the matchers consume the new tokens, and the output processor turns them
into text and decides which sequences end."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque

from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import RequestError
from qwenserve.core.kv_cache_manager import KVCacheManager
from qwenserve.core.request import Sequence
from qwenserve.core.scheduler import Scheduler
from qwenserve.core.speculation import Speculation, SpeculationStats
from qwenserve.core.step import ModelRunnerOutput, SchedulerOutput
from qwenserve.engine.input_processor import InputProcessor, ProcessedRequest
from qwenserve.engine.output_processor import OutputProcessor
from qwenserve.engine.outputs import RequestOutput
from qwenserve.engine.structured_output import StructuredOutputManager
from qwenserve.executor.abstract import Executor, ExecutorDeadError
from qwenserve.executor.multiproc_executor import MultiprocExecutor
from qwenserve.executor.uniproc_executor import UniProcExecutor
from qwenserve.lora.registry import AdapterRegistry
from qwenserve.lora.request import LoRARequest
from qwenserve.model.loader.resolve import load_tokenizer, resolve_draft_model, resolve_model
from qwenserve.model.models.qwen2_vl_processor import Qwen2VLProcessor
from qwenserve.sample.grammar import GrammarCompiler
from qwenserve.sample.sampling_params import SamplingParams
from qwenserve.sample.structured_outputs import FIELD

logger = logging.getLogger(__name__)
GiB = 1 << 30
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GRAMMAR_WAIT_S = 0.02  # with nothing to run but grammars compiling, how long a step waits for one


class StepFailedError(RuntimeError):
    """The model raised while running a step (a bug or a fault, not a bad request): the requests in that step
    fail with it, the others go on."""


class GrammarBrokenError(RuntimeError):
    """A constrained sequence's grammar refused what the sequence wrote, although the step's mask allowed it (or
    it came in the unmasked free text's last token): the engine's failure, not the request's, so never blamed
    on a field the client sent."""


class RequestsFailedError(RuntimeError):
    """A step ended some requests with an error while the others go on: `failures` maps each failed request id
    to its error (its blocks are already freed); `outputs` are the step's outputs for the others.
    faulty_step: the model step itself failed (a fault, which the server's health counts); False when only
    the requests were at fault (a grammar that cannot compile)."""

    def __init__(self, failures: dict[str, Exception], outputs: list[RequestOutput] = (), faulty_step: bool = True):
        super().__init__(f"{len(failures)} requests failed: " + "; ".join(sorted({str(e) for e in failures.values()})))
        self.failures = failures
        self.outputs = list(outputs)
        self.faulty_step = faulty_step


class LLMEngine:
    def __init__(self, config: EngineConfig, replica_rank: int = 0):
        """replica_rank: which of config's data_parallel_size replicas this is (its workers take their share of
        the CPUs); a DataParallelEngine makes one LLMEngine per replica. The checkpoint is resolved here unless
        config already carries it (resolved_model), and the workers receive it inside self.config."""
        if config.resolved_model is None:
            config = dataclasses.replace(config, resolved_model=resolve_model(config.load))
        resolved = config.resolved_model
        self.tokenizer = load_tokenizer(resolved)
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and config.resolved_draft_model is None:
            config = dataclasses.replace(config, resolved_draft_model=resolve_draft_model(
                config.load, spec.model, resolved, self.tokenizer))
        self.config = config
        self.resolved_model = resolved
        self.model_id = resolved.model_id
        self.max_model_len = resolved.max_model_len
        generation = resolved.generation_config
        # sampling defaults from the checkpoint, for requests that do not set them (the server applies them)
        self.generation_defaults = {k: generation[k] for k in GENERATION_DEFAULT_KEYS if generation.get(k) is not None}

        self.executor = make_executor(config, replica_rank)
        self.kv_cache_budget = self.executor.kv_cache_budget  # bytes per worker ("auto" resolved)
        self.kv = KVCacheManager(self.executor.num_kv_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching, self.executor.kv_block_bytes)
        self.weights_bytes = self.executor.weights_bytes
        logger.info("memory: weights %d bytes (%.2f GiB); KV cache %d blocks reserved, %d bytes (%.2f GiB), its "
                    "pages touched as blocks are first used, so resident memory grows with the traffic",
                    self.weights_bytes, self.weights_bytes / GiB, self.kv.num_blocks, self.kv.reserved_bytes,
                    self.kv.reserved_bytes / GiB)
        lora = config.lora
        # a draft model writes its proposals' K/V ahead of the sequence: their slots are allocated with the step
        speculation = None if spec is None else Speculation(
            spec.num_speculative_tokens, self.max_model_len, spec.disable_by_batch_size, spec.min_acceptance_rate,
            lookahead_slots=spec.num_speculative_tokens if spec.method == "draft_model" else 0)
        self.scheduler = Scheduler(self.kv, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
                                   self.executor.max_concurrent_batches, config.scheduler.pipelined_step_tokens,
                                   lora.max_loras if lora.enable_lora else None, speculation)
        self._in_flight: deque[SchedulerOutput] = deque()  # submitted steps, oldest first
        eos_token_ids = frozenset(resolved.stop_token_ids(self.tokenizer))
        self.adapters = AdapterRegistry(resolved.config, lora.max_lora_rank) if lora.enable_lora else None
        vision = resolved.config.vision
        image_processor = (Qwen2VLProcessor(vision, resolved.preprocessor_config, resolved.video_preprocessor_config)
                           if vision is not None else None)
        self.input_processor = InputProcessor(self.tokenizer, resolved.config.vocab_size, self.max_model_len,
                                              eos_token_ids, config.cache.block_size, self.kv.num_blocks,
                                              self.adapters, image_processor, config.multimodal.limit_mm_per_prompt)
        self.structured_output = StructuredOutputManager(
            GrammarCompiler(self.tokenizer, resolved.config.vocab_size, eos_token_ids))
        self._request_failures: dict[str, Exception] = {}  # failed between steps; raised by the next finish_step
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len, config.record_logits)
        self.num_aborted = 0  # requests stopped before their end (client gone, or an explicit abort)
        self._seq_ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """lora_request: the LoRA adapter to run with (enable_lora); None: the base model."""
        self.add_processed_request(
            request_id, self.input_processor.process(prompt, params or SamplingParams(), lora_request), arrival_time)

    def add_processed_request(self, request_id: str, request: ProcessedRequest,
                              arrival_time: float | None = None) -> None:
        """add_request for a prompt already tokenized and checked (a data-parallel router does that once)."""
        if request_id in self.output_processor.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        params = request.params
        lora = request.lora_request
        salt = (lora.cache_salt if lora is not None else b"") + self._length_salt(len(request.prompt_token_ids))
        seqs = [Sequence(seq_id=next(self._seq_ids), request_id=request_id, index=i,
                         token_ids=list(request.prompt_token_ids), num_prompt_tokens=len(request.prompt_token_ids),
                         params=params.child(i) if params.n > 1 else params, lora_request=lora,
                         cache_salt=salt, images=request.images)
                for i in range(params.n)]
        seqs[0].fork_children = seqs[1:]  # siblings start from the first one's prompt blocks
        self.output_processor.add_request(request_id, request, seqs, arrival_time or time.time())
        if params.structured_outputs is not None:
            self.structured_output.add(request_id, seqs)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add(seqs[0])

    def _length_salt(self, prompt_len: int) -> bytes:
        """The prefix-cache key a prompt's length adds: under dual-chunk attention past its
        original_max_position_embeddings every layer's K/V depend on the prompt's length (its temperature), so
        only prompts of one length share blocks; otherwise nothing."""
        dca = self.resolved_model.config.dual_chunk
        if dca is None or dca.temperature(prompt_len) == 1.0:
            return b""
        return b"dca-prompt-length:%d" % prompt_len

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Accept an adapter before any request names it, checked as a request's adapter is (its config and the
        safetensors header), so a broken one fails here (RequestError naming the field or tensor)."""
        self.input_processor.check_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: new requests may no longer name it (its name is free for another adapter), while
        those already admitted run to their end with it; the workers drop its weights as the least recently used
        when others need the room. False if the id names no adapter."""
        return self.adapters is not None and self.adapters.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.adapters.adapters) if self.adapters is not None else set()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once. Returns its final output, or None if unknown."""
        output, live = self.output_processor.abort(request_id)
        if output is not None:
            self.num_aborted += 1
            self._end(request_id, live)
        return output

    def _end(self, request_id: str, live: list[Sequence]) -> None:
        """Free an ended request's sequences still live: blocks, and grammar matchers or compile."""
        self.scheduler.finish(live)
        self.structured_output.release(live)
        self.structured_output.abort(request_id)

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    # ---- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Fill the executor's queue of steps, then finish the oldest."""
        self.submit_steps()
        return self.finish_step()

    def submit_steps(self) -> None:
        """Schedule and submit steps until the executor has as many in flight as it runs at once (or there is
        nothing to schedule)."""
        self._admit_compiled()
        while len(self._in_flight) < self.executor.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty:
                break
            self.structured_output.attach_bitmask(scheduler_output)
            self.executor.submit(scheduler_output)
            self._in_flight.append(scheduler_output)

    def _admit_compiled(self) -> None:
        """Hand the scheduler the requests whose grammar is now compiled; fail those whose grammar did not."""
        ready, failed = self.structured_output.take_ready()
        for seqs in ready:
            self.scheduler.add(seqs[0])
        for request_id, error in failed.items():
            _, live = self.output_processor.abort(request_id)
            self._end(request_id, live)
            self._request_failures[request_id] = error

    def finish_step(self) -> list[RequestOutput]:
        """Wait for the oldest step in flight and turn its tokens into outputs ([] if none is in flight)."""
        if not self._in_flight:
            if self.structured_output.num_compiling:  # nothing to run but grammars to wait for: no busy loop
                self.structured_output.wait(GRAMMAR_WAIT_S)
            return self._outputs_or_failures([])
        scheduler_output = self._in_flight.popleft()
        try:
            runner_output = self.executor.collect()
        except ExecutorDeadError:
            raise
        except Exception as e:  # noqa: BLE001 (the model failed on this batch: end its requests, keep the rest)
            raise RequestsFailedError(self._end_step_requests(scheduler_output, e)) from e
        if runner_output.failed_loras:
            runner_output = self._fail_adapter_requests(scheduler_output, runner_output)
        ran = self.scheduler.update_from_output(scheduler_output, runner_output)
        grammar_complete, grammar_broken = self.structured_output.advance(runner_output)
        broken_requests = {self.structured_output.request_of(seq_id): why for seq_id, why in grammar_broken.items()}
        outputs, finished = self.output_processor.process(ran, runner_output, grammar_complete)
        self.scheduler.finish(finished)
        self.structured_output.release(finished)
        for request_id, why in broken_requests.items():  # never returned unconstrained: the request fails
            logger.error("request %s: its grammar rejected a sampled token: %s", request_id, why)
            _, live = self.output_processor.abort(request_id)
            self._end(request_id, live)
            self._request_failures[request_id] = GrammarBrokenError(
                f"{FIELD}: the output could not be kept to the grammar ({why.splitlines()[0] if why else why})")
        return self._outputs_or_failures(outputs)

    def _fail_adapter_requests(self, scheduler_output: SchedulerOutput,
                               runner_output: ModelRunnerOutput) -> ModelRunnerOutput:
        """End the requests of the step whose adapter a worker could not load (their rows ran without it) with
        an error naming the adapter, and return the step's output without their rows; the others go on."""
        failed_seqs = set()
        for seq in self.scheduler.live_in_step(scheduler_output):
            why = runner_output.failed_loras.get(seq.lora_int_id) if seq.lora_request is not None else None
            if why is None or seq.request_id in self._request_failures:
                continue
            name = seq.lora_request.lora_name
            for sibling in self.output_processor.requests[seq.request_id].seqs:
                self.kv.uncache_unwritten(sibling)
                failed_seqs.add(sibling.seq_id)
            _, live = self.output_processor.abort(seq.request_id)
            self._end(seq.request_id, live)
            self._request_failures[seq.request_id] = RequestError(
                f"LoRA adapter {name!r} could not be loaded: {why}", param="lora_request")
        keep = [i for i, seq_id in enumerate(runner_output.seq_ids) if seq_id not in failed_seqs]
        return dataclasses.replace(
            runner_output, seq_ids=[runner_output.seq_ids[i] for i in keep],
            sampled_token_ids=[runner_output.sampled_token_ids[i] for i in keep],
            logprobs=[runner_output.logprobs[i] for i in keep] if runner_output.logprobs else runner_output.logprobs,
            logits=[runner_output.logits[i] for i in keep] if runner_output.logits is not None else None,
            prompt_logprobs={k: v for k, v in runner_output.prompt_logprobs.items() if k not in failed_seqs},
            draft_token_ids={k: v for k, v in runner_output.draft_token_ids.items() if k not in failed_seqs},
            failed_loras={})

    def _outputs_or_failures(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """outputs, or RequestsFailedError carrying them if requests failed since the last step."""
        if not self._request_failures:
            return outputs
        failures, self._request_failures = self._request_failures, {}
        raise RequestsFailedError(failures, [o for o in outputs if o.request_id not in failures], faulty_step=False)

    def _end_step_requests(self, scheduler_output: SchedulerOutput, error: Exception) -> dict[str, Exception]:
        """End every request with a sequence in a failed step and free its blocks; returns their errors."""
        logger.error("a model step failed (%s: %s); ending its requests", type(error).__name__, error,
                     exc_info=error)
        request_ids = {seq.request_id for seq in self.scheduler.drop_step(scheduler_output)}
        failure = StepFailedError(f"the model step running this request failed: {type(error).__name__}: {error}")
        for request_id in request_ids:
            _, live = self.output_processor.abort(request_id)
            self._end(request_id, live)
        return dict.fromkeys(request_ids, failure)

    # ---- state, for the server's gauges ---------------------------------------------------------------

    @property
    def num_waiting_requests(self) -> int:
        """Requests with a sequence waiting (or a grammar compiling), each counted once however many of its n
        samples wait."""
        return len({seq.request_id for seq in self.scheduler.waiting}) + self.structured_output.num_compiling

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the whole KV cache holds (one request can never use more)."""
        return self.kv.num_blocks * self.kv.block_size

    @property
    def num_live_sequences(self) -> int:
        """Sequences running or waiting: this engine's load, for a data-parallel router."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def lora_stats(self) -> dict:
        """Requests running and waiting per adapter name (each request once, however many samples it has), and
        max_loras; empty without enable_lora."""
        if self.adapters is None:
            return {}

        def per_adapter(seqs) -> dict[str, int]:
            requests: dict[str, set[str]] = {}
            for seq in seqs:
                if seq.lora_request is not None:
                    requests.setdefault(seq.lora_request.lora_name, set()).add(seq.request_id)
            return {name: len(ids) for name, ids in requests.items()}
        return {"running": per_adapter(self.scheduler.running), "waiting": per_adapter(self.scheduler.waiting),
                "max_loras": self.config.lora.max_loras}

    def stats(self) -> dict:
        kv = self.kv
        speculation = self.scheduler.speculation
        spec = speculation.stats if speculation is not None else SpeculationStats()
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_usage": kv.usage, "hit_rate": kv.hits / kv.queries if kv.queries else 0.0,
                "prefix_hit_tokens": kv.hits, "prefix_query_tokens": kv.queries,
                "aborted": self.num_aborted, "free_blocks": kv.num_free_blocks, "num_blocks": kv.num_blocks,
                "weights_bytes": self.weights_bytes, "kv_reserved_bytes": kv.reserved_bytes,
                "kv_touched_bytes": kv.touched_bytes,
                # speculative decoding (zeros when off): verifications, drafts verified, drafts accepted
                "spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
                "spec_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_accepted_per_position": list(spec.accepted_per_position),
                "spec_mean_acceptance_length": spec.mean_acceptance_length,
                "speculating": speculation is not None, "num_preemptions": self.scheduler.num_preemptions,
                "block_size": kv.block_size,
                "lora": self.lora_stats()}


def make_executor(config: EngineConfig, replica_rank: int = 0) -> Executor:
    """The executor for a resolved config (config.resolved_model set)."""
    backend = config.parallel.backend
    if backend == "uni":
        return UniProcExecutor(config)
    if backend == "ray":
        from qwenserve.executor.ray_executor import RayExecutor  # Ray is an optional extra
        return RayExecutor(config)
    return MultiprocExecutor(config, replica_rank)

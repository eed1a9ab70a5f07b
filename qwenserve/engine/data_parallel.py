"""Data parallel: data_parallel_size engine replicas, each with its own workers (processes on this host, or Ray
actors), scheduler and KV cache, behind the LLMEngine interface, so the offline API and the server use them
as one engine.

Routing. Each request goes to one replica: the one that most recently took the longest prefix of its prompt
(whole KV blocks), since that replica probably still caches it, unless that replica is busier than the least
loaded one by more than AFFINITY_MAX_EXTRA_LOAD sequences; otherwise the least loaded. The router remembers
prefixes it routed (an LRU of block hashes), not what each cache holds, so requests that share a system prompt
and arrive together still meet on one replica (the scheme of SGLang's cache-aware router, without the tree).

Stepping. All replicas with work submit their steps first, then each step is collected in turn, so the
replicas' workers compute at the same time.

Faults. A replica whose workers die leaves the pool: its requests fail with ReplicaDeadError (step() raises
RequestsFailedError, which carries them and the other replicas' outputs of that step), new requests go to the
others. Only when the last one dies is the engine dead (ExecutorDeadError).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections import OrderedDict

from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import RequestError
from qwenserve.engine.llm_engine import LLMEngine, RequestsFailedError
from qwenserve.engine.outputs import RequestOutput
from qwenserve.executor.abstract import ExecutorDeadError
from qwenserve.sample.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
AFFINITY_MAX_EXTRA_LOAD = 8  # sequences a replica may run beyond the least loaded and still get its prefixes
ROUTED_PREFIXES = 1 << 16  # block hashes the router remembers


class ReplicaDeadError(ExecutorDeadError):
    """The data-parallel replica running a request is gone (the others serve on)."""


def build_engine(config: EngineConfig) -> LLMEngine | DataParallelEngine:
    """The engine for config: one LLMEngine, or replicas behind a router when data_parallel_size > 1."""
    if config.parallel.data_parallel_size > 1:
        return DataParallelEngine(config)
    return LLMEngine(config)


class DataParallelEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        size = config.parallel.data_parallel_size
        # the first replica sizes an "auto" KV cache for all (it divides this host's memory by every replica's
        # workers); the others get that size and start together
        first = LLMEngine(config, 0)
        config = first.config  # resolved once: the other replicas take the first one's resolved_model
        if config.cache.kv_cache_memory == "auto":
            config = dataclasses.replace(config, cache=dataclasses.replace(
                config.cache, kv_cache_memory=first.executor.kv_cache_budget))
        with concurrent.futures.ThreadPoolExecutor(size - 1) as pool:
            futures = [pool.submit(LLMEngine, config, rank) for rank in range(1, size)]
            concurrent.futures.wait(futures)
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for replica in [first] + [f.result() for f in futures if f.exception() is None]:
                replica.shutdown()
            raise failed[0]
        self.replicas: list[LLMEngine] = [first] + [f.result() for f in futures]
        self.alive = [True] * size
        self.resolved_model, self.tokenizer, self.model_id = first.resolved_model, first.tokenizer, first.model_id
        self.max_model_len, self.generation_defaults = first.max_model_len, first.generation_defaults
        self.input_processor, self.kv_cache_budget = first.input_processor, first.kv_cache_budget
        self.block_size = config.cache.block_size
        self._owner: dict[str, int] = {}  # live request id -> replica
        self._routed: OrderedDict[int, int] = OrderedDict()  # prompt prefix (chained block hash) -> replica
        self.num_routed = [0] * size
        self.num_prefix_routed = 0  # requests sent where their prefix went before
        logger.info("%d data-parallel replicas ready", size)

    # ---- requests -------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request=None) -> None:
        """lora_request: refused (LoRA runs without data parallelism for now), as an engine without
        enable_lora refuses it."""
        if request_id in self._owner:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not any(self.alive):
            raise ExecutorDeadError("every data-parallel replica has stopped")
        request = self.input_processor.process(prompt, params or SamplingParams(), lora_request)
        prefixes = self._prefix_hashes(request.prompt_token_ids)
        rank = self._route(prefixes)
        self.replicas[rank].add_processed_request(request_id, request, arrival_time)
        self._owner[request_id] = rank
        self.num_routed[rank] += 1
        for digest in prefixes:
            self._routed[digest] = rank
            self._routed.move_to_end(digest)
        while len(self._routed) > ROUTED_PREFIXES:
            self._routed.popitem(last=False)

    def _prefix_hashes(self, token_ids: list[int]) -> list[int]:
        """A chained hash per whole block of the prompt (only for routing: a collision just misroutes)."""
        hashes, parent = [], 0
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(token_ids[start:start + self.block_size])))
            hashes.append(parent)
        return hashes

    def _route(self, prefixes: list[int]) -> int:
        load = [r.num_live_sequences if ok else float("inf") for r, ok in zip(self.replicas, self.alive)]
        least = min(range(len(load)), key=lambda i: (load[i], self.num_routed[i]))
        for digest in reversed(prefixes):  # the longest prefix routed before
            rank = self._routed.get(digest)
            if rank is not None:
                if self.alive[rank] and load[rank] <= load[least] + AFFINITY_MAX_EXTRA_LOAD:
                    self.num_prefix_routed += 1
                    return rank
                break
        return least

    def abort_request(self, request_id: str) -> RequestOutput | None:
        rank = self._owner.pop(request_id, None)
        if rank is None or not self.alive[rank]:
            return None
        return self.replicas[rank].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    # ---- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        busy = [i for i, r in enumerate(self.replicas) if self.alive[i] and r.has_unfinished_requests()]
        dead: dict[int, Exception] = {}
        failures: dict[str, Exception] = {}
        faulty_step = False
        for i in busy:
            try:
                self.replicas[i].submit_steps()
            except ExecutorDeadError as e:
                dead[i] = e
        outputs: list[RequestOutput] = []
        for i in busy:
            if i in dead:
                continue
            try:
                replica_outputs = self.replicas[i].finish_step()
            except ExecutorDeadError as e:
                dead[i] = e
                continue
            except RequestsFailedError as e:  # some of the replica's requests failed; it serves on
                failures.update(e.failures)
                replica_outputs = e.outputs
                faulty_step = faulty_step or e.faulty_step
            for out in replica_outputs:
                out.metrics.engine_index = i
            outputs.extend(replica_outputs)
        for rank, error in dead.items():
            failures.update(self._remove(rank, error))
        for request_id in failures:
            self._owner.pop(request_id, None)
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        if dead and not any(self.alive):
            raise ExecutorDeadError("every data-parallel replica has stopped (" +
                                    "; ".join(f"replica {rank}: {error}" for rank, error in dead.items()) + ")")
        if failures:
            raise RequestsFailedError(failures, outputs, faulty_step or bool(dead))
        return outputs

    def _remove(self, rank: int, error: Exception) -> dict[str, Exception]:
        """Take a dead replica out of the pool; returns its requests, each with the error to fail it with."""
        self.alive[rank] = False
        self.replicas[rank].shutdown()
        lost = [rid for rid, owner in self._owner.items() if owner == rank]
        logger.error("data-parallel replica %d stopped (%s); failing its %d requests, %d replicas serve on", rank,
                     error, len(lost), sum(self.alive))
        failure = ReplicaDeadError(f"the data-parallel replica {rank} serving this request stopped: {error}")
        return dict.fromkeys(lost, failure)

    # ---- state, for the server's gauges ---------------------------------------------------------------

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens one replica's KV cache holds: a request runs on one replica."""
        return self.replicas[0].kv_cache_tokens

    @property
    def num_waiting_requests(self) -> int:
        return sum(r.num_waiting_requests for r, ok in zip(self.replicas, self.alive) if ok)

    def _zero_stats(self) -> dict:
        """A replica's stats() with nothing in it: what a replica that left the pool reports."""
        return {key: 0 for key in self.replicas[0].stats()} | {"spec_accepted_per_position": [], "lora": {},
                                                               "speculating": False}

    def stats(self) -> dict:
        """The totals (as LLMEngine.stats()) and, under "replicas", each replica's, with "alive" and "routed"."""
        per_replica = []
        for rank, (replica, ok) in enumerate(zip(self.replicas, self.alive)):
            stats = replica.stats() if ok else self._zero_stats()
            per_replica.append(stats | {"alive": ok, "routed": self.num_routed[rank]})
        live = [s for s in per_replica if s["alive"]] or per_replica
        total = {key: sum(s[key] for s in live) for key in ("running", "waiting", "aborted", "free_blocks",
                                                            "num_blocks", "prefix_hit_tokens", "prefix_query_tokens",
                                                            "weights_bytes", "kv_reserved_bytes", "kv_touched_bytes",
                                                            "spec_num_drafts", "spec_num_draft_tokens",
                                                            "spec_num_accepted_tokens", "num_preemptions")}
        total["spec_accepted_per_position"] = [sum(at) for at in zip(*(s["spec_accepted_per_position"]
                                                                       for s in live))]
        total["speculating"] = any(s["speculating"] for s in per_replica)
        total["block_size"] = max(s["block_size"] for s in per_replica)
        total["kv_usage"] = 1 - total["free_blocks"] / total["num_blocks"] if total["num_blocks"] else 0.0
        queries = total["prefix_query_tokens"]
        total["hit_rate"] = total["prefix_hit_tokens"] / queries if queries else 0.0
        drafts = total["spec_num_drafts"]
        total["spec_mean_acceptance_length"] = 1 + total["spec_num_accepted_tokens"] / drafts if drafts else 0.0
        return total | {"replicas": per_replica, "prefix_routed": self.num_prefix_routed}

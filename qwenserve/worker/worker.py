"""A worker owns what runs the model in one process: the weights, the KV cache tensors, and the model runner
(which holds the per-sequence state and the sampler). The executor drives it one step at a time."""
from __future__ import annotations

import dataclasses
import logging

import torch

from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import resolve_kv_cache_dtype
from qwenserve.kernels import use_cpu_kernels
from qwenserve.lora.manager import LoRAManager
from qwenserve.core.step import ModelRunnerOutput, SchedulerOutput
from qwenserve.distributed.groups import init_model_parallel
from qwenserve.distributed.pipeline import PipelineParallel
from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.model.layers.attention import PagedKVCache, decode_kernel_available
from qwenserve.model.loader.model_loader import load_model
from qwenserve.spec_decode.draft_model import DraftModelProposer
from qwenserve.spec_decode.ngram_proposer import NgramProposer
from qwenserve.worker.cpu_tuning import keep_large_allocations_in_heap
from qwenserve.worker.memory import KVCacheFit, kv_cache_budget, model_weights_bytes
from qwenserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    """Built in two steps, so that several workers can agree on one pool of KV blocks: load the model, then
    `init_kv_cache` with the fewest blocks any of them fits (the engine's one scheduler hands out block ids
    for all)."""

    def __init__(self, config: EngineConfig, tp: TensorParallel = TensorParallel(),
                 pp: PipelineParallel | None = None):
        """config: the engine's, with its resolved_model (what to load). pp: this rank's pipeline stage; None: the
        only stage, holding pp_layer_partition's one count (checked against the model's layers as any stage's
        are)."""
        resolved = config.resolved_model
        if resolved is None:
            raise ValueError("a worker needs the EngineConfig its engine resolved (resolved_model is None)")
        if pp is None:
            pp = PipelineParallel(layer_partition=config.parallel.pp_layer_partition)
        self.config = config
        self.device = torch.device(config.load.device)
        if self.device.type == "cpu":
            keep_large_allocations_in_heap()
        # the layers choose their implementation (and the kernels' variant) when built
        with use_cpu_kernels(config.load.cpu_kernels, config.load.cpu_isa, config.load.enforce_eager):
            self.model = load_model(resolved, self.device, tp, pp)
            # speculative decoding's draft model (the engine allows it only in a lone worker), whole
            self.draft_model = (load_model(config.resolved_draft_model, self.device)
                                if config.resolved_draft_model is not None else None)
        self.max_model_len = resolved.max_model_len
        # with LoRA on, every projection an adapter may target is wrapped now, before any adapter is loaded
        self.lora_manager = (LoRAManager(self.model, resolved.config, config.lora) if config.lora.enable_lora
                             else None)
        spec = self.model.kv_cache_spec()
        self._kv_shape = (spec.num_layers, config.cache.block_size, spec.num_kv_heads, spec.head_dim)
        self._kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype) or spec.dtype
        self._draft_kv = None  # the draft's (shape, dtype) per block, beside the target's under the same block ids
        if self.draft_model is not None:
            draft = self.draft_model.kv_cache_spec()
            self._draft_kv = ((draft.num_layers, config.cache.block_size, draft.num_kv_heads, draft.head_dim),
                              resolve_kv_cache_dtype(config.cache.kv_cache_dtype) or draft.dtype)
        self.kv_cache: PagedKVCache | None = None
        self.draft_kv_cache: PagedKVCache | None = None
        self.model_runner: ModelRunner | None = None

    def kv_blocks_that_fit(self, workers_sharing: int = 1) -> KVCacheFit:
        """As many blocks as this worker's budget holds for its layers and kv heads, the budget being
        kv_cache_memory, or with "auto" its share (one of workers_sharing, all loaded) of the memory available now,
        bounded by what max_num_seqs sequences of max_model_len tokens fill; never more blocks than that bound
        either way (more would never be used)."""
        per_block = self._bytes_per_block()
        most_usable = self.config.scheduler.max_num_seqs * -(-self.max_model_len // self._kv_shape[1])
        budget = kv_cache_budget(self.config.cache.kv_cache_memory, self.device, workers_sharing,
                                 most_usable * per_block)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_memory {budget} bytes is less than one KV block ({per_block} bytes for "
                              f"{self._kv_shape[1]} tokens)")
        weights = model_weights_bytes(self.model)
        if self.draft_model is not None:
            weights += model_weights_bytes(self.draft_model)
        return KVCacheFit(min(num_blocks, most_usable), budget, per_block, weights)

    def _bytes_per_block(self) -> int:
        """One block id's bytes: the target's layers, and the draft model's where it runs."""
        per_block = PagedKVCache.bytes_per_block(*self._kv_shape, self._kv_dtype)
        if self._draft_kv is not None:
            per_block += PagedKVCache.bytes_per_block(*self._draft_kv[0], self._draft_kv[1])
        return per_block

    def init_kv_cache(self, num_blocks: int) -> None:
        num_layers, block_size, num_kv_heads, head_dim = self._kv_shape
        per_block = self._bytes_per_block()
        logger.info("KV cache: %d blocks of %d tokens = %d tokens max (%s%s), %d bytes reserved (%.2f GiB); pages "
                    "become resident as blocks are first used", num_blocks, block_size, num_blocks * block_size,
                    str(self._kv_dtype).removeprefix("torch."),
                    " codes, per-token scales" if self._kv_dtype != self.model.dtype else "",
                    num_blocks * per_block, num_blocks * per_block / (1 << 30))
        if self._draft_kv is not None:
            logger.info("speculative decoding: the draft model's K/V sit in the same blocks (%d of each block's %d "
                        "bytes)", PagedKVCache.bytes_per_block(*self._draft_kv[0], self._draft_kv[1]), per_block)
        self.kv_cache = PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, self._kv_dtype,
                                     self.device)
        with use_cpu_kernels(self.config.load.cpu_kernels, self.config.load.cpu_isa):
            proposer = self._proposer(num_blocks)
            self.model_runner = ModelRunner(self.model, self.kv_cache, self.device, self.config.record_logits,
                                            self.lora_manager, self.config.multimodal.encoder_cache_memory,
                                            proposer)

    def _proposer(self, num_blocks: int) -> NgramProposer | DraftModelProposer | None:
        """Speculative decoding's proposer (None: off); a draft model's with its cache of num_blocks blocks."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self._draft_kv is None:
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        (num_layers, block_size, num_kv_heads, head_dim), dtype = self._draft_kv
        self.draft_kv_cache = PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                           self.device)
        draft = self.config.resolved_draft_model
        return DraftModelProposer(self.draft_model, self.draft_kv_cache, self.config.resolved_model.config.vocab_size,
                                  draft.config.vocab_size, draft.max_model_len, decode_kernel_available(self.device))

    @property
    def num_kv_blocks(self) -> int:
        return len(self.kv_cache.k[0])

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's sampled tokens, or None on a pipeline stage that is not the last."""
        return self.model_runner.execute_model(scheduler_output)


def init_rank_worker(rank: int, config: EngineConfig, init_method: str, shm_name: str | None) -> Worker:
    """In a worker process of any executor: pick this rank's device, join the other ranks (torch.distributed
    at init_method: gloo on CPU, NCCL on CUDA), and load this rank's part of the model. shm_name: the ranks of
    each tensor-parallel group share a host, so they may all-reduce through shared memory of that name.
    config: the engine's, resolved (its resolved_model says what to load)."""
    parallel = config.parallel
    device = torch.device(config.load.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        config = dataclasses.replace(config, load=dataclasses.replace(config.load, device=str(device)))
    tp, pp = init_model_parallel(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, init_method,
                                 "nccl" if device.type == "cuda" else "gloo", shm_name, parallel.pp_layer_partition,
                                 parallel.enable_expert_parallel)
    return Worker(config, tp, pp)

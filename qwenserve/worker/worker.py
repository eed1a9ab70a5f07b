"""A worker owns what runs the model in one process: the weights, the KV cache tensors, and the model runner
(which holds the per-sequence state and the sampler). The executor drives it one step at a time."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import resolve_kv_cache_dtype
from qwenserve.core.step import ModelRunnerOutput, SchedulerOutput
from qwenserve.model.layers.attention import PagedKVCache
from qwenserve.model.loader.model_loader import ModelSpec
from qwenserve.model.parallel import PipelineParallel, TensorParallel
from qwenserve.worker.cpu_tuning import keep_large_allocations_in_heap
from qwenserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, spec: ModelSpec, tp: TensorParallel = TensorParallel(),
                 pp: PipelineParallel = PipelineParallel()):
        self.device = torch.device(config.load.device)
        if self.device.type == "cpu":
            keep_large_allocations_in_heap()
        self.model = spec.load_model(self.device, tp, pp)
        self.kv_cache = self._allocate_kv_cache(config, spec)
        self.num_kv_blocks = len(self.kv_cache.k[0])
        self.model_runner = ModelRunner(self.model, self.kv_cache, self.device, config.record_logits)

    def _allocate_kv_cache(self, config: EngineConfig, spec: ModelSpec) -> PagedKVCache:
        """As many blocks as the memory budget holds for this worker's layers and kv heads; with several workers,
        the fewest any of them holds (one scheduler hands out block ids for all)."""
        layers = self.model.model.own_layers
        attn = layers[0].self_attn
        num_layers, block_size = len(layers), config.cache.block_size
        dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype) or spec.dtype
        per_block = PagedKVCache.bytes_per_block(num_layers, block_size, attn.num_kv_heads, attn.head_dim, dtype)
        num_blocks = config.cache.kv_cache_memory // per_block
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_memory {config.cache.kv_cache_memory} bytes is less than one KV block "
                              f"({per_block} bytes for {block_size} tokens)")
        if dist.is_initialized():
            fewest = torch.tensor([num_blocks])
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
            num_blocks = int(fewest)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens max, %.2f GiB (%s%s)", num_blocks, block_size,
                    num_blocks * block_size, num_blocks * per_block / (1 << 30), str(dtype).removeprefix("torch."),
                    " codes, per-token scales" if dtype != spec.dtype else "")
        return PagedKVCache(num_layers, num_blocks, block_size, attn.num_kv_heads, attn.head_dim, dtype, self.device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's sampled tokens, or None on a pipeline stage that is not the last."""
        return self.model_runner.execute_model(scheduler_output)

"""What the executors with one worker process per rank share, wherever the processes run (multiproc_executor.py:
spawned on this host; ray_executor.py: Ray actors across a cluster): the layout check before any worker starts,
which rank returns the sampled tokens, the KV block handshake, how a failed worker ends the executor, and the
workers' log format."""
from __future__ import annotations

import logging
from abc import abstractmethod

from qwenserve.config.engine_config import EngineConfig
from qwenserve.distributed.layout import check_parallel_layout
from qwenserve.executor.abstract import Executor, ExecutorDeadError
from qwenserve.worker.memory import KVCacheFit

logger = logging.getLogger(__name__)
HEALTH_CHECK_SECONDS = 0.5  # how often a waiting engine looks for a dead or failed worker


class DistributedExecutor(Executor):
    """Ranks are numbered as init_model_parallel numbers them: rank r is tensor rank r % tp of stage r // tp.
    A subclass starts its workers after this __init__, sets `_finalizer` (a weakref.finalize that stops them),
    has them load, then calls `_agree_on_kv_blocks`."""
    _finalizer = None

    def __init__(self, config: EngineConfig):
        parallel = config.parallel
        self.config = config
        self.tp_size, self.pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.world_size = self.tp_size * self.pp_size
        # here, rather than in every worker after it started
        check_parallel_layout(config.resolved_model.config, self.tp_size, self.pp_size, parallel.pp_layer_partition,
                              parallel.enable_expert_parallel)
        self.max_concurrent_batches = self.pp_size
        self.output_rank = (self.pp_size - 1) * self.tp_size  # the last stage's first tensor rank
        self._dead: str | None = None  # why no further step can run

    def _shm_all_reduce_name(self, port: int, hosts: list) -> str | None:
        """The shared memory a stage's tensor ranks all-reduce through, named after the rendezvous port (unique
        on its host while the executor lives); None unless each stage's tensor ranks share a host. hosts[rank]:
        the machine rank runs on."""
        tp = self.tp_size
        one_host_per_stage = all(len(set(hosts[s * tp:(s + 1) * tp])) == 1 for s in range(self.pp_size))
        return f"qwenserve-allreduce-{port}" if one_host_per_stage else None

    def _agree_on_kv_blocks(self, hosts: list) -> int:
        """Once every worker has loaded its part (so the memory left is what the KV caches may share), ask each
        how many KV blocks it fits, then have every worker make its cache with the fewest (the engine's one
        scheduler hands out block ids for all); returns that. With "auto", a machine's memory is shared by the
        ranks on it (hosts[rank]: its machine), and by as many of every other replica's (a DataParallelEngine
        sizes the first replica so, then gives the others that size)."""
        parallel = self.config.parallel
        replicas = parallel.data_parallel_size if self.config.cache.kv_cache_memory == "auto" else 1
        fitting = self._kv_blocks_that_fit([hosts.count(host) * replicas for host in hosts])
        num_blocks = min(fit.num_blocks for fit in fitting)
        self.kv_cache_budget = min(fit.budget for fit in fitting)
        self.kv_block_bytes = sum(fit.bytes_per_block for fit in fitting)
        self.weights_bytes = sum(fit.weights_bytes for fit in fitting)
        self._init_kv_caches(num_blocks)
        return num_blocks

    @abstractmethod
    def _kv_blocks_that_fit(self, workers_sharing: list[int]) -> list[KVCacheFit]:
        """What every rank fits (blocks, budget, memory figures), given how many workers share each rank's
        memory."""

    @abstractmethod
    def _init_kv_caches(self, num_blocks: int) -> None:
        """Every rank makes its KV cache of num_blocks blocks; returns once all have."""

    def _fail(self, failures: list[str]) -> None:
        """End the executor for good. One death often takes a peer with it (its collective breaks), so callers
        name every failed rank, the likelier cause first."""
        self._dead = "; ".join(failures)
        logger.error("%s; stopping the other workers", self._dead)
        self.shutdown(reason=self._dead)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)

    def shutdown(self, reason: str = "the executor was shut down") -> None:
        if self._dead is None:
            self._dead = reason
        if self._finalizer is not None:
            self._finalizer()


def worker_log_level() -> int:
    """The engine's log level, which its workers log at."""
    return logging.getLogger("qwenserve").getEffectiveLevel()


def set_up_worker_logging(rank: int, level: int) -> None:
    """In a worker process: log to stderr at the engine's level, each line marked with the rank."""
    logging.basicConfig(level=level, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")

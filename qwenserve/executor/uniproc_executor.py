"""The executor that runs one worker in the engine's own process."""
from __future__ import annotations

from collections import deque

from qwenserve.config.engine_config import EngineConfig
from qwenserve.core.step import ModelRunnerOutput, SchedulerOutput
from qwenserve.executor.abstract import Executor
from qwenserve.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.worker = Worker(config)
        fit = self.worker.kv_blocks_that_fit()
        self.worker.init_kv_cache(fit.num_blocks)
        self.kv_cache_budget, self.kv_block_bytes = fit.budget, fit.bytes_per_block
        self.weights_bytes = fit.weights_bytes
        self.num_kv_blocks = self.worker.num_kv_blocks
        self._submitted: deque[SchedulerOutput] = deque()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self._submitted.append(scheduler_output)  # run in collect(): there is nothing to overlap with

    def collect(self) -> ModelRunnerOutput:
        return self.worker.execute_model(self._submitted.popleft())

"""The executor that runs one worker in the engine's own process."""
from __future__ import annotations

from qwenserve.config.engine_config import EngineConfig
from qwenserve.core.step import ModelRunnerOutput, SchedulerOutput
from qwenserve.executor.abstract import Executor
from qwenserve.model.loader.model_loader import ModelSpec
from qwenserve.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, spec: ModelSpec):
        self.worker = Worker(config, spec)
        self.num_kv_blocks = self.worker.num_kv_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

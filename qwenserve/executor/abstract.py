"""The executor interface: how the engine runs the model, wherever the workers are. The engine hands it each
step's SchedulerOutput and gets back a ModelRunnerOutput; it never sees a tensor. Today's implementation is
in-process (uniproc_executor.py); multiprocess and Ray executors come behind the same interface."""
from __future__ import annotations

from abc import ABC, abstractmethod

from qwenserve.core.step import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    num_kv_blocks: int  # KV cache blocks every worker holds (the scheduler's pool)

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ...

    def shutdown(self) -> None:
        """Release the workers (a no-op in process)."""

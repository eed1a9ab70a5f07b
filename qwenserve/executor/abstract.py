"""The executor interface: how the engine runs the model, wherever the workers are. The engine submits each
step's SchedulerOutput and collects ModelRunnerOutputs in the same order; it never sees a tensor. Up to
`max_concurrent_batches` steps may be in flight at once (one per pipeline stage), so no stage waits for the
engine between steps. Implementations: in the engine's process (uniproc_executor.py), and one process per rank
(distributed_executor.py's base): worker processes on this host (multiproc_executor.py) or Ray actors across a
cluster (ray_executor.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from qwenserve.core.step import ModelRunnerOutput, SchedulerOutput


class ExecutorDeadError(RuntimeError):
    """A worker is gone (it died, or failed a step): the executor cannot run another step."""


class Executor(ABC):
    num_kv_blocks: int  # KV cache blocks every worker holds (the scheduler's pool)
    kv_cache_budget: int  # bytes of KV cache each worker was given (kv_cache_memory, or what "auto" came to)
    kv_block_bytes: int  # bytes one block id takes in all the workers' caches together
    weights_bytes: int  # bytes of weights all the workers hold together
    max_concurrent_batches: int = 1

    @abstractmethod
    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step (it may run while earlier ones finish)."""

    @abstractmethod
    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step, waiting for it; ExecutorDeadError if a worker is gone."""

    def shutdown(self) -> None:
        """Release the workers (a no-op in process)."""

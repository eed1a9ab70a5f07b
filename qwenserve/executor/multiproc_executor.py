"""The executor that runs one worker process per rank on this host (tensor_parallel_size x
pipeline_parallel_size of them, spawned), joined by torch.distributed: gloo on CPU, NCCL on CUDA.

Each step's SchedulerOutput is broadcast to every worker through shared memory (shm_queue.py); the last
stage's first tensor rank returns the sampled tokens through a second queue. Every worker runs the same
scheduler deltas, so their sequence state agrees without further messages.

Failure and exit: a worker that fails a step reports the traceback on its pipe to the engine and exits; the
engine sees a dead worker within half a second (while it waits for output), stops the others and raises
ExecutorDeadError. A worker exits by itself when the engine's end of its pipe closes, which the kernel does
even when the engine is killed with SIGKILL, so no worker outlives the engine.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import sys
import threading
import traceback
import weakref

from qwenserve.config.engine_config import EngineConfig
from qwenserve.core.step import ModelRunnerOutput, SchedulerOutput
from qwenserve.distributed.groups import free_port
from qwenserve.executor.distributed_executor import (
    HEALTH_CHECK_SECONDS,
    DistributedExecutor,
    set_up_worker_logging,
    worker_log_level,
)
from qwenserve.executor.shm_queue import ShmQueue
from qwenserve.worker.cpu_tuning import bind_to_cpus, cpu_sets_for_ranks
from qwenserve.worker.memory import KVCacheFit
from qwenserve.worker.worker import init_rank_worker

logger = logging.getLogger(__name__)
THIS_HOST = "this host"  # the machine of every rank (DistributedExecutor counts the ranks that share one)
STOP_SECONDS = 5.0  # how long shutdown waits for a worker to leave by itself before killing it


class WorkerStartError(RuntimeError):
    """A worker process failed before it could serve (bad checkpoint, out of memory, ...)."""


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, replica_rank: int = 0):
        """replica_rank: this engine's index among data_parallel_size replicas; its workers take that share of
        the CPUs."""
        super().__init__(config)
        world = self.world_size
        ctx = multiprocessing.get_context("spawn")
        self._steps = ShmQueue(ctx, num_readers=world)
        self._results = ShmQueue(ctx, num_readers=1)
        self._results_reader = self._results.reader(0)
        port = free_port()
        init_method = f"tcp://127.0.0.1:{port}"
        # every rank is on this host: tensor ranks may all-reduce through shared memory
        shm_name = self._shm_all_reduce_name(port, [THIS_HOST] * world)
        self._procs, self._conns = [], []
        cpu_sets = cpu_sets_for_ranks(world * config.parallel.data_parallel_size,
                                      config.parallel.cpu_omp_threads_bind)[replica_rank * world:][:world]
        for rank, cpus in enumerate(cpu_sets):
            engine_end, worker_end = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker, name=f"qwenserve-worker-{rank}", daemon=True,
                args=(rank, config, self._steps.reader(rank), self._results if rank == self.output_rank else None,
                      worker_end, cpus, init_method, shm_name, worker_log_level()))
            with _main_module_hidden():
                proc.start()
            worker_end.close()  # the worker holds the only other end: its EOF is the engine's exit
            self._procs.append(proc)
            self._conns.append(engine_end)
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns, self._steps,
                                           self._results)
        try:
            for rank in range(world):
                self._receive(rank, "loaded")
            self.num_kv_blocks = self._agree_on_kv_blocks([THIS_HOST] * world)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d worker processes ready (tensor parallel %d x pipeline parallel %d, %s)", world,
                    self.tp_size, self.pp_size, init_method)

    def _kv_blocks_that_fit(self, workers_sharing: list[int]) -> list[KVCacheFit]:
        for conn, sharing in zip(self._conns, workers_sharing):
            conn.send(("fit", sharing))
        return [self._receive(rank, "fits")[0] for rank in range(len(self._procs))]

    def _init_kv_caches(self, num_blocks: int) -> None:
        for conn in self._conns:
            conn.send(("kv_blocks", num_blocks))
        for rank in range(len(self._procs)):
            self._receive(rank, "ready")

    def _receive(self, rank: int, expected: str) -> list:
        """The payload of worker rank's next message, which must be `expected`; its error, raised here, if it
        failed instead. No collective runs while workers start, so the first error is the cause, not an echo
        of another worker's failure."""
        proc, conn = self._procs[rank], self._conns[rank]
        while not conn.poll(HEALTH_CHECK_SECONDS):
            if not proc.is_alive():
                break
        try:
            kind, *payload = conn.recv()
        except EOFError:
            proc.join(STOP_SECONDS)
            raise WorkerStartError(f"worker rank {rank} exited with code {proc.exitcode} while starting") from None
        if kind == "error":
            error, text = payload
            logger.error("worker rank %d failed to start:\n%s", rank, text)
            raise error
        assert kind == expected, (kind, expected)
        return payload

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.check_health()
        self._steps.put(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        while True:
            try:
                return self._results_reader.get(timeout=HEALTH_CHECK_SECONDS)
            except queue.Empty:
                self.check_health()

    def check_health(self) -> None:
        if self._dead is None:
            dead = [rank for rank, proc in enumerate(self._procs) if not proc.is_alive()]
            if dead:
                # a killed one (negative exit code: a signal) first, as it is the likelier cause
                dead.sort(key=lambda rank: self._procs[rank].exitcode >= 0)
                self._fail([f"worker rank {rank} (pid {self._procs[rank].pid}) exited with code "
                            f"{self._procs[rank].exitcode}{self._failure_of(rank)}" for rank in dead])
        self._raise_if_dead()

    def _failure_of(self, rank: int) -> str:
        """': <the error it reported>' if the worker said why it stopped."""
        conn = self._conns[rank]
        try:
            if conn.poll(0):
                kind, error, text = conn.recv()
                logger.error("worker rank %d failed:\n%s", rank, text)
                return f": {type(error).__name__}: {error}"
        except (EOFError, OSError, ValueError):
            pass
        return ""


def _stop_workers(procs, conns, steps: ShmQueue, results: ShmQueue) -> None:
    """Ask every worker to leave, kill those that do not, then free the queues. With one already dead the
    others are killed at once: they may be waiting on it inside a collective, and would never leave."""
    graceful = all(p.is_alive() for p in procs)
    if graceful:
        try:
            steps.put(None)  # every reader takes it; a live worker is never a whole ring behind
        except Exception:  # noqa: BLE001 (shutting down: the kill below still runs)
            pass
    for proc in procs:
        proc.join(timeout=STOP_SECONDS if graceful else 0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=STOP_SECONDS)
    for conn in conns:
        conn.close()
    steps.close()
    results.close()


@contextlib.contextmanager
def _main_module_hidden():
    """Spawn re-imports the parent's __main__ in the child, which reruns a user's script that has no
    `if __name__ == "__main__"` guard (and so starts another engine). A worker needs nothing from __main__,
    so it is hidden while the process starts."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


# ---- the worker process -----------------------------------------------------------------------------------

def run_worker(rank: int, config: EngineConfig, steps: ShmQueue, results: ShmQueue | None, conn,
               cpus: set[int] | None, init_method: str, shm_name: str | None, log_level: int) -> None:
    """Main of a worker process: join the others, load this rank's part of the model, then run steps until
    the engine says stop (None) or goes away."""
    set_up_worker_logging(rank, log_level)
    from_engine: queue.Queue = queue.Queue()
    threading.Thread(target=_watch_engine, args=(conn, from_engine), daemon=True, name="engine-watch").start()
    try:
        bind_to_cpus(cpus)
        worker = init_rank_worker(rank, config, init_method, shm_name)
        conn.send(("loaded",))
        _, workers_sharing = from_engine.get()
        conn.send(("fits", worker.kv_blocks_that_fit(workers_sharing)))
        _, num_blocks = from_engine.get()
        worker.init_kv_cache(num_blocks)
    except Exception as e:  # noqa: BLE001 (reported to the engine, which raises it)
        _report_and_exit(conn, e)
    conn.send(("ready",))
    while True:
        scheduler_output = steps.get()
        if scheduler_output is None:
            break
        try:
            output = worker.execute_model(scheduler_output)
        except Exception as e:  # noqa: BLE001 (a bug: the engine fails the requests and stops the workers)
            _report_and_exit(conn, e)
        if results is not None:
            results.put(output)
    os._exit(0)  # no interpreter teardown: the process group and its threads need no goodbye


def _report_and_exit(conn, error: Exception) -> None:
    text = traceback.format_exc()
    try:
        conn.send(("error", error, text))
    except Exception:  # noqa: BLE001 (an exception that does not pickle travels as its text)
        conn.send(("error", RuntimeError(f"{type(error).__name__}: {error}"), text))
    os._exit(1)


def _watch_engine(conn, inbox: queue.Queue) -> None:
    """Pass the engine's messages to the main thread; when the engine's end of the pipe closes (EOF), leave."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        pass
    os._exit(0)

"""The executor whose workers are Ray actors, so one model spans the machines of a Ray cluster (`ray start --head`
on one, `ray start --address=HEAD:6379` on each other; the engine joins the cluster named by RAY_ADDRESS, else
the one started on this machine, else starts a local one: ray.init's own choice).

One actor per rank (tensor x pipeline parallel, ranks numbered as in the mp executor), placed by a placement
group of one bundle per rank (PACK: as few machines as possible; ray_cpus_per_worker CPUs each, or a GPU each
on CUDA). The ranks join torch.distributed at rank 0's address. Settings reach the actors inside the pickled
EngineConfig, not through their environment (Ray starts them with the raylet's). Each step's SchedulerOutput
goes into Ray's object store once and every actor runs it; the last stage's first rank returns the sampled
tokens. An actor runs its calls in order, so with pipeline parallel the first stage takes step k+1 while the
last still runs step k.

Failure and exit: an actor that dies or raises fails its step's object ref; the engine polls all of a step's refs
while it waits, so the error surfaces within half a second, and the other actors are killed (they may be
blocked in a collective with the dead one). The actors belong to the engine's process: Ray kills them when it
exits, even by SIGKILL.
"""
from __future__ import annotations

import logging
import os
import weakref
from collections import deque

import torch

from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import ConfigError
from qwenserve.core.step import ModelRunnerOutput, SchedulerOutput
from qwenserve.distributed.groups import free_port
from qwenserve.executor.abstract import ExecutorDeadError
from qwenserve.executor.distributed_executor import (
    HEALTH_CHECK_SECONDS,
    DistributedExecutor,
    set_up_worker_logging,
    worker_log_level,
)
from qwenserve.worker.memory import KVCacheFit
from qwenserve.worker.worker import Worker, init_rank_worker

logger = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_SECONDS = 60.0  # how long to wait for the cluster to find room for every worker


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("distributed_executor_backend 'ray' needs Ray: pip install 'qwenserve[ray]'") from None
    return ray


class RayWorker:
    """One rank, as a Ray actor (RayExecutor wraps the class with ray.remote)."""

    def __init__(self, rank: int, config: EngineConfig, log_level: int, num_threads: int):
        set_up_worker_logging(rank, log_level)
        if config.load.device == "cpu":
            torch.set_num_threads(num_threads)
        self.rank, self.config = rank, config
        self.worker: Worker | None = None

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, node IP address, pid) of this actor."""
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        return free_port()

    def load(self, init_method: str, shm_name: str | None) -> None:
        """Join the others and load this rank's part."""
        self.worker = init_rank_worker(self.rank, self.config, init_method, shm_name)

    def kv_blocks_that_fit(self, workers_sharing: int) -> KVCacheFit:
        """The KV blocks this rank fits, its budget and memory figures, once every rank has loaded."""
        return self.worker.kv_blocks_that_fit(workers_sharing)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.worker.execute_model(scheduler_output)


class RayExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig):
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(config)
        world = self.world_size
        self._in_flight: deque[list] = deque()  # each submitted step's object refs, one per rank
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING)  # the cluster at RAY_ADDRESS, else this machine's, else a new one

        cuda = torch.device(config.load.device).type == "cuda"
        cpus = config.parallel.ray_cpus_per_worker
        bundle = {"GPU": 1.0} if cuda else {"CPU": float(cpus)}
        self._placement = placement_group([bundle] * world, strategy="PACK")
        self._actors: list = []
        self._finalizer = weakref.finalize(self, _release, self._actors, self._placement)
        try:
            self._wait_for_placement(ray, bundle, world)
            actor_class = ray.remote(RayWorker)
            for rank in range(world):
                self._actors.append(actor_class.options(
                    num_cpus=0 if cuda else cpus, num_gpus=1 if cuda else 0, name=None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement, rank),
                ).remote(rank, config, worker_log_level(), cpus))
            self.rank_locations = self._wait_all([a.where.remote() for a in self._actors], starting=True)
            self.num_kv_blocks = self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray workers ready on %d node(s) (tensor parallel %d x pipeline parallel %d)", world,
                    len({node for node, _, _ in self.rank_locations}), self.tp_size, self.pp_size)

    def _wait_for_placement(self, ray, bundle: dict, world: int) -> None:
        total = ray.cluster_resources()
        short = {k: f"{total.get(k, 0):g} of {v * world:g}" for k, v in bundle.items() if total.get(k, 0) < v * world}
        if short:
            raise ConfigError(f"the Ray cluster cannot hold {world} workers of {bundle} each: it has "
                              f"{', '.join(f'{k} {n}' for k, n in short.items())} needed (add nodes, or lower "
                              f"ray_cpus_per_worker)")
        try:
            ray.get(self._placement.ready(), timeout=PLACEMENT_TIMEOUT_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"the Ray cluster has no room for {world} workers of {bundle} each within "
                              f"{PLACEMENT_TIMEOUT_SECONDS:.0f} s; it has {ray.available_resources()} free "
                              f"(lower ray_cpus_per_worker or add nodes)") from None

    def _start_workers(self) -> int:
        """Join the ranks at rank 0's address, load, and agree on the fewest KV blocks any rank fits."""
        import ray
        port = ray.get(self._actors[0].free_port.remote())
        init_method = f"tcp://{self.rank_locations[0][1]}:{port}"
        nodes = [node for node, _, _ in self.rank_locations]
        shm_name = self._shm_all_reduce_name(port, nodes)
        self._wait_all([a.load.remote(init_method, shm_name) for a in self._actors], starting=True)
        return self._agree_on_kv_blocks(nodes)

    def _kv_blocks_that_fit(self, workers_sharing: list[int]) -> list[KVCacheFit]:
        return self._wait_all([a.kv_blocks_that_fit.remote(sharing)
                               for a, sharing in zip(self._actors, workers_sharing)], starting=True)

    def _init_kv_caches(self, num_blocks: int) -> None:
        self._wait_all([a.init_kv_cache.remote(num_blocks) for a in self._actors], starting=True)

    def _wait_all(self, refs: list, starting: bool = False) -> list:
        """The results of refs (one per rank), polling all of them so that a failed rank is noticed while the
        others wait on it; each result is fetched once, as it arrives. A failure raises its cause while
        starting, else ExecutorDeadError."""
        import ray
        results, errors = [None] * len(refs), {}
        rank_of = {ref: rank for rank, ref in enumerate(refs)}

        def settle(ready: list) -> None:
            for ref in ready:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    errors[rank_of[ref]] = e

        pending = list(refs)
        while pending and not errors:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=HEALTH_CHECK_SECONDS)
            settle(ready)
        if not errors:
            return results
        # one death often breaks a peer's collective too: let the others settle, then name every failed rank,
        # a dead actor first (the likelier cause)
        if pending:
            settle(ray.wait(pending, num_returns=len(pending), timeout=HEALTH_CHECK_SECONDS)[0])
        failed = sorted(errors.items(), key=lambda item: (not isinstance(item[1], ray.exceptions.RayActorError),
                                                          item[0]))
        self._fail([f"worker rank {rank} (Ray actor) failed: {_describe(e)}" for rank, e in failed])
        cause = getattr(failed[0][1], "cause", None)
        if starting and isinstance(cause, Exception):
            raise cause from None
        raise ExecutorDeadError(self._dead) from None

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        import ray
        self._raise_if_dead()
        step = ray.put(scheduler_output)  # serialized once, read by every actor
        self._in_flight.append([a.execute_model.remote(step) for a in self._actors])

    def collect(self) -> ModelRunnerOutput:
        self._raise_if_dead()
        return self._wait_all(self._in_flight.popleft())[self.output_rank]


def _describe(error) -> str:
    """A Ray error as its cause (an actor's exception) or its first line (a dead actor)."""
    cause = getattr(error, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(error).splitlines()[0]


def _release(actors: list, placement) -> None:
    """Kill the actors and free their placement group (Ray itself stays up: another executor in this process,
    a data-parallel replica, may still use it)."""
    import ray
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 (already gone)
            pass
    try:
        ray.util.remove_placement_group(placement)
    except Exception:  # noqa: BLE001 (already removed, or Ray is shutting down)
        pass

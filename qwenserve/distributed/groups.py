"""Joining a process to the others: the torch.distributed world of tensor x pipeline ranks, its groups, the
shared-memory all-reduce of ranks on one host, and a free port for the rendezvous."""
from __future__ import annotations

import random
import socket

import torch.distributed as dist

from qwenserve.distributed.pipeline import PipelineParallel
from qwenserve.distributed.shm_all_reduce import ShmAllReduce, shm_all_reduce_supported
from qwenserve.distributed.tensor_parallel import TensorParallel


# ports taken below the kernel's ephemeral range, which outgoing connections draw from: a port found free there is
# not handed to another process's connection before the rendezvous listens on it (Ray's processes open many)
_RENDEZVOUS_PORTS = range(20000, 32768)
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_start() -> int:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous: one below the ephemeral range where
    one is free, else any the kernel hands out."""
    below = range(_RENDEZVOUS_PORTS.start, min(_RENDEZVOUS_PORTS.stop, _ephemeral_start()))
    for port in random.sample(below, min(20, len(below))):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_model_parallel(rank: int, tp_size: int, pp_size: int, init_method: str, backend: str,
                        shm_name: str | None = None,
                        layer_partition: tuple[int, ...] | None = None,
                        expert_parallel: bool = False) -> tuple[TensorParallel, PipelineParallel]:
    """Join the world of tp_size * pp_size processes and build its groups. Rank r is tensor rank r % tp_size
    of stage r // tp_size (vLLM's layout: the ranks of one stage are neighbours). shm_name: all ranks share
    this host, so a stage's tensor ranks all-reduce through shared memory of that name (on the CPU).
    layer_partition: layers per stage (None: balanced). expert_parallel: each stage's tensor ranks hold whole
    experts (enable_expert_parallel)."""
    world = tp_size * pp_size
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    tp_group = pp_group = None
    # every process creates every group, in the same order (a torch.distributed rule)
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for tp_rank in range(tp_size):
        ranks = list(range(tp_rank, world, tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            pp_group = group
    shm = None
    if shm_name and backend == "gloo" and tp_size > 1 and shm_all_reduce_supported():
        shm = _attach_shm_all_reduce(rank % tp_size, tp_size, f"{shm_name}-{rank // tp_size}", tp_group)
    return (TensorParallel(rank % tp_size, tp_size, tp_group, shm, expert_parallel),
            PipelineParallel(rank // tp_size, pp_size, pp_group, layer_partition))


def _attach_shm_all_reduce(tp_rank: int, tp_size: int, name: str, group) -> ShmAllReduce:
    """Tensor rank 0 creates the segment, the others attach, then its name is removed (see ShmAllReduce)."""
    shm = ShmAllReduce(tp_rank, tp_size, name, create=True) if tp_rank == 0 else None
    dist.barrier(group=group)
    if shm is None:
        shm = ShmAllReduce(tp_rank, tp_size, name, create=False)
    dist.barrier(group=group)
    if tp_rank == 0:
        shm.unlink()
    return shm

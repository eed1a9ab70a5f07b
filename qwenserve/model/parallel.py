"""Who this process is within its tensor-parallel group and its pipeline: passed to every parallel layer
explicitly. Also the one place that joins a process to the others (`init_model_parallel`)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from qwenserve.model.shm_all_reduce import ShmAllReduce, shm_all_reduce_supported


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed process group when size > 1
    shm: ShmAllReduce | None = None  # the same ranks through shared memory (one host, CPU)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if self.shm is not None and x.device.type == "cpu":
                return self.shm.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def shard_kv_heads(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(kv heads this rank owns, index of its first kv head in the checkpoint).

    With at least as many kv heads as ranks they are split evenly; with fewer, each rank holds one kv head,
    replicated across the tp // num_kv_heads ranks whose query heads use it."""
    if num_kv_heads >= tp.size:
        per_rank = num_kv_heads // tp.size
        return per_rank, tp.rank * per_rank
    return 1, tp.rank // (tp.size // num_kv_heads)


def check_parallel_layout(config, tp_size: int, pp_size: int) -> None:
    """Raise ValueError, naming the numbers, if the model (a ModelConfig) cannot be split this way; run in the
    engine before any worker starts."""
    check_head_split(config.num_attention_heads, config.num_key_value_heads, tp_size)
    PipelineParallel(0, pp_size, layer_partition=layer_partition_from_env()).layer_range(config.num_hidden_layers)


def check_head_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide num_attention_heads {num_heads} "
                         f"(num_key_value_heads {num_kv_heads})")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide num_key_value_heads {num_kv_heads} "
                         f"(num_attention_heads {num_heads})")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp_size} is not a multiple of num_key_value_heads {num_kv_heads} "
                         f"(num_attention_heads {num_heads}), so kv heads cannot be replicated evenly")


@dataclass(frozen=True)
class PipelineParallel:
    """This process's stage: which layers it owns, and the neighbours it takes activations from and passes
    them to (hidden states and the residual stream, stacked into one [2, tokens, hidden] message)."""
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed process group of this tp rank across the stages
    layer_partition: tuple[int, ...] | None = None  # layers per stage; None: balanced (see layer_range)
    # the send still in progress: (its work handle, the message it must keep alive)
    _in_progress: list = field(default_factory=list, compare=False, repr=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int, layer_cost: float = 1.0, head_cost: float = 0.0) -> tuple[int, int]:
        """[start, end) of the layers this stage owns: the given partition, or contiguous ranges that balance the
        weight each stage reads per step (layers at layer_cost each, plus the LM head's head_cost on the last)."""
        counts = self.layer_partition or balanced_partition(num_layers, self.size, layer_cost, head_cost)
        if len(counts) != self.size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"layer partition {list(counts)} does not give each of {self.size} pipeline stages "
                             f"at least one of the model's {num_layers} layers")
        start = sum(counts[:self.rank])
        return start, start + counts[self.rank]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Pass this stage's output on without waiting for the next stage to take it (it may still be busy
        with the previous batch); the previous message is waited for first, so at most one is queued."""
        for work, _ in self._in_progress:
            work.wait()
        message = torch.stack((hidden, residual))
        self._in_progress[:] = [(dist.isend(message, group=self.group, group_dst=self.rank + 1), message)]

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        message = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(message, group=self.group, group_src=self.rank - 1)
        return message[0], message[1]


def balanced_partition(num_layers: int, num_stages: int, layer_cost: float = 1.0,
                       head_cost: float = 0.0) -> tuple[int, ...]:
    """Layers per stage, contiguous: the last stage, which also pays head_cost, takes the number of layers
    that makes the costliest stage cheapest; the others split the rest evenly (earlier stages take any
    remainder)."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} is more than the model's {num_layers} layers")
    if num_stages == 1:
        return (num_layers,)
    first = num_stages - 1

    def worst(last: int) -> float:
        return max(-(-(num_layers - last) // first) * layer_cost, last * layer_cost + head_cost)

    last = min(range(1, num_layers - first + 1), key=lambda k: (worst(k), k))
    rest = num_layers - last
    return tuple(rest // first + (i < rest % first) for i in range(first)) + (last,)


def layer_partition_from_env() -> tuple[int, ...] | None:
    """QWENSERVE_PP_LAYER_PARTITION="14,10": layers per stage, overriding the balanced split."""
    text = os.environ.get("QWENSERVE_PP_LAYER_PARTITION")
    if not text:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"QWENSERVE_PP_LAYER_PARTITION={text!r} is not a comma-separated list of layer counts")


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_model_parallel(rank: int, tp_size: int, pp_size: int, init_method: str, backend: str,
                        shm_name: str | None = None) -> tuple[TensorParallel, PipelineParallel]:
    """Join the world of tp_size * pp_size processes and build its groups. Rank r is tensor rank r % tp_size
    of stage r // tp_size (vLLM's layout: the ranks of one stage are neighbours). shm_name: all ranks share
    this host, so a stage's tensor ranks all-reduce through shared memory of that name (on the CPU)."""
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
    return (TensorParallel(rank % tp_size, tp_size, tp_group, shm),
            PipelineParallel(rank // tp_size, pp_size, pp_group, layer_partition_from_env()))


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

"""Who this process is within its tensor-parallel group, and the collectives its parallel layers call: passed to
every parallel layer explicitly."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from qwenserve.distributed.shm_all_reduce import ShmAllReduce


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed process group when size > 1
    shm: ShmAllReduce | None = None  # the same ranks through shared memory (one host, CPU)
    # enable_expert_parallel: a layer's experts are placed whole on these ranks instead of sliced (model/layers/moe.py)
    expert_parallel: bool = False

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

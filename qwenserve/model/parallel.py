"""Who this process is within its tensor-parallel group. Passed to every parallel layer explicitly."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed process group when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
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

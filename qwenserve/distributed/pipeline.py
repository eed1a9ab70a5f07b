"""Who this process is within its pipeline: the layers its stage owns, and the activations it takes from the
previous stage and passes to the next."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from qwenserve.distributed.partition import stage_layer_counts


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
        counts = stage_layer_counts(num_layers, self.size, self.layer_partition, layer_cost, head_cost)
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

"""Vocabulary-parallel embedding and LM head: each rank owns a contiguous range of token ids."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import TensorParallel
from .linear import cpu_weight_packing_available, pack_weight, packed_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)  # ceil: the last shard may be padded
        self.start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.vocab_size:
            raise ValueError(f"{type(self).__name__}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"the model expects ({self.vocab_size}, {param.shape[1]})")
        rows = min(self.shard_size, self.vocab_size - self.start)
        param.data[:rows].copy_(loaded.narrow(0, self.start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        owned = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * owned.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary (each rank computes its slice, then gather)."""

    packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """As the linear layers do (see _ParallelLinear.pack_for_cpu). A tied head keeps the shared weight for
        the embedding lookup, so packing it costs one more copy of the vocabulary matrix."""
        if self.packed_weight is None and cpu_weight_packing_available(self.weight):
            self.packed_weight = pack_weight(self.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            logits = packed_linear(hidden.contiguous(), self.packed_weight, None)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last_dim(logits)
        return logits[..., :self.vocab_size]

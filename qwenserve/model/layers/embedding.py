"""Vocabulary-parallel embedding and LM head: each rank owns a contiguous range of token ids."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.kernels import cpu_ops_for
from qwenserve.model.layers.linear import LinearMethod, UnquantizedLinearMethod
from qwenserve.model.layers.quantization.ggml_blocks import GGMLBlockLinearMethod
from qwenserve.model.loader.ggml_tensor import GGMLTensor


class VocabParallelEmbedding(nn.Module):
    """keep_blocks: a GGUF file's quantized embedding stays in its blocks (a quarter to a third of a bf16 copy)
    and each lookup dequantizes only the rows it reads, with our kernel; without the kernels it is dense. A tied
    LM head computes on the same blocks (ParallelLMHead.tie_to)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = TensorParallel(),
                 keep_blocks: bool = False):
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.shard_size = -(-vocab_size // tp.size)  # ceil: the last shard may be padded
        self.start = tp.rank * self.shard_size
        self.dtype = torch.get_default_dtype()
        self.ops = cpu_ops_for(torch.empty(0).device) if keep_blocks else None
        self.blocks = None  # this rank's rows as a GGMLTensor, when kept
        self._create_weight(hidden_size)

    def _create_weight(self, hidden_size: int) -> None:
        rows = 0 if self.ops is not None else self.shard_size  # kept blocks: allocated when they arrive
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.takes_ggml_blocks = self.ops is not None

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"{type(self).__name__}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"the model expects ({self.vocab_size}, {self.hidden_size})")
        rows = min(self.shard_size, self.vocab_size - self.start)
        if isinstance(loaded, GGMLTensor):
            self.blocks = loaded.narrow(0, self.start, rows)
            return
        if param.shape[0] != self.shard_size:  # blocks were wanted, but the file holds this tensor dense
            param.data = torch.zeros(self.shard_size, self.hidden_size, dtype=self.dtype, device=param.device)
        param.data[:rows].copy_(loaded.narrow(0, self.start, rows))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return F.embedding(ids, self.weight)
        rows = self.blocks.take_rows(ids)
        out = self.ops.ggml_dequantize(rows.raw, int(rows.ggml_type), self.hidden_size, self.dtype)
        return out.view(*ids.shape, self.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.start
        owned = (local >= 0) & (local < self.shard_size)
        held = self.shard_size if self.blocks is None else self.blocks.shape[0]
        out = self._lookup(local.clamp(0, held - 1)) * owned.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary (each rank computes its slice, then gather). Its
    matmul is a linear method's, like any linear layer's (its weight too, so a quantized head stays quantized).
    A tied head shares the embedding's weight: its quantized blocks where the embedding keeps them (the head's
    block method runs them, as llama.cpp multiplies the embedding's own blocks), else its dense weight."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = TensorParallel(),
                 linear_method: LinearMethod | None = None):
        self.linear_method = linear_method or UnquantizedLinearMethod()
        super().__init__(vocab_size, hidden_size, tp)
        self.weight_is_shared = False
        self.tied_embedding: VocabParallelEmbedding | None = None

    def _create_weight(self, hidden_size: int) -> None:
        self.input_size, self.output_size = hidden_size, self.shard_size
        self.linear_method.create_weights(self, hidden_size, self.shard_size)

    def output_shard(self, shard_id=None) -> tuple[int, int, int]:
        """This rank's vocabulary rows (the last shard may be padded: its padding rows are never loaded)."""
        return 0, min(self.shard_size, self.vocab_size - self.start), self.start

    def input_shard(self) -> tuple[int, int]:
        return 0, self.input_size

    def checkpoint_shape(self, shard_id=None) -> tuple[int, int]:
        return self.vocab_size, self.input_size

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight: one parameter, so the checkpoint's one tensor fills both. Whether the
        head runs the embedding's blocks or its dense weight is settled after loading, when it is known which
        the embedding holds."""
        if not isinstance(self.linear_method, (UnquantizedLinearMethod, GGMLBlockLinearMethod)):
            raise ValueError(f"a tied LM head shares the embedding's weight; it cannot take "
                             f"{type(self.linear_method).__name__}")
        self.weight = embedding.weight
        self.weight_is_shared = True  # the embedding lookup still reads it
        self.tied_embedding = embedding

    def process_weights_after_loading(self) -> None:
        embedding = self.tied_embedding
        if embedding is not None and embedding.blocks is not None and isinstance(self.linear_method,
                                                                                 GGMLBlockLinearMethod):
            self.segments = [(0, embedding.blocks)]
            self.linear_method.process_weights_after_loading(self)
            # one copy of the blocks, in the layout the head's kernels read; the lookup reads either layout
            embedding.blocks = self.segments[0][1]
            return
        if embedding is not None and not isinstance(self.linear_method, UnquantizedLinearMethod):
            # the file holds the embedding dense (or the kernels are off): the head shares that dense weight
            self.linear_method = UnquantizedLinearMethod()
            self.packed_weight = None
        self.linear_method.process_weights_after_loading(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear_method.apply(self, hidden, None)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last_dim(logits)
        return logits[..., :self.vocab_size]

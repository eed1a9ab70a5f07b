"""A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k experts, each expert is a
SiLU-gated MLP, and a token's output is its experts' outputs weighted by the router's probabilities.

The experts are held one of two ways. Dense (HF checkpoints, and GGUF files where our CPU kernels do not run or
whose experts are float): stacked, [experts, 2 * intermediate, hidden] and [experts, hidden, intermediate] in the
run dtype, each expert's slice also a parameter named as checkpoints name it (experts.E.gate_up_proj.weight,
experts.E.down_proj.weight, after the loader's gate/up fusion), so the loader fills them as it fills any fused
projection; the tokens are grouped by expert and only the chosen experts run, in PyTorch. An FP8 checkpoint's
experts (quantization/fp8.py) are held that way too, as e4m3 codes with their scales per row beside them (s13, s2,
named weight_scale_inv / weight_scale as the checkpoint names them; made at load under online fp8), run one byte a
weight by the FP8 linear path (fp8_linear); where its quantization_config leaves them unquantized they are dense
(FusedExperts.checkpoint_named). As blocks (a GGUF file under the `gguf` quantization, where the kernels
run): each expert's parameters are placeholders whose loaders keep the file's blocks, stacked per projection once
loaded, and one ggml_moe call runs the chosen experts on them (quantization/gguf_experts.py). Under tensor
parallelism each rank holds its slice of every expert's intermediate dimension (vLLM's default); the partial outputs
are summed with one all-reduce. With enable_expert_parallel (tp.expert_parallel) each rank instead holds a
contiguous range of whole experts (distributed/layout.py's local_experts) and nothing of the others, whose
checkpoint tensors its placeholders take and drop; every rank routes every token, runs only the (token, expert)
pairs of its own experts, and the same all-reduce sums the ranks' parts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.config.errors import ConfigError
from qwenserve.config.tuning import this_cpu_tuning
from qwenserve.distributed.layout import check_expert_split, local_experts
from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.model.layers.quantization.fp8 import (E4M3, expert_config, experts_left_dense, fill_scales, fp8_linear,
                                                     fp8_ops, load_codes, quantize_online_slice)
from qwenserve.model.layers.quantization.ggml_blocks import activation_levels
from qwenserve.model.layers.quantization.gguf_experts import ExpertBlockCollector, expert_kernels


class TopKRouter(nn.Module):
    """Router logits -> softmax over all experts (in float32) -> the top k, renormalised to sum to one where
    `renormalize` (config.json's norm_topk_prob)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class _ExpertProjection(nn.Module):
    """One expert's gate_up_proj or down_proj: a view of the stacked weights that loads this rank's slice. Under an
    FP8 checkpoint (fp8: its format) the weight holds e4m3 codes and a second view, named as the checkpoint names
    the scales, holds them per row (quantization/fp8.py); under online fp8 the codes and scales are made from each
    dense checkpoint tensor as it loads."""

    def __init__(self, weight: torch.Tensor, tp: TensorParallel, fused_gate_up: bool, fp8=None,
                 scales: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # shares the stacked tensor's storage
        self.weight.weight_loader = self.weight_loader
        self.tp, self.fused_gate_up, self.fp8 = tp, fused_gate_up, fp8
        self.online_scales = scales if fp8 is not None and fp8.online else None  # no checkpoint tensor fills them
        if fp8 is not None and not fp8.online:
            param = nn.Parameter(scales, requires_grad=False)
            param.weight_loader = self.scale_loader
            setattr(self, fp8.scale_name, param)

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.fused_gate_up:
            size = param.shape[0] // 2
            fill_scales(self.fp8, param.data, loaded, shard_id * size, size, self.tp.rank * size, 0,
                        self.weight.shape[1], exact=self.tp.size == 1)
        else:
            size = self.weight.shape[1]
            fill_scales(self.fp8, param.data, loaded, 0, param.shape[0], 0, self.tp.rank * size, size,
                        exact=self.tp.size == 1)

    def checkpoint_shape(self) -> tuple[int, int]:
        """(rows, columns) of the expert's whole checkpoint gate, up or down weight, of which every rank keeps a
        part."""
        rows, columns = self.weight.shape
        if self.fused_gate_up:
            return rows // 2 * self.tp.size, columns
        return rows, columns * self.tp.size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.fp8 is not None:  # the codes, as bytes
            if self.online_scales is None:
                loaded = load_codes(self.fp8, loaded)
            param = nn.Parameter(param.data.view(torch.uint8), requires_grad=False)
        whole, expected = loaded, self.checkpoint_shape()
        if tuple(loaded.shape) != expected:  # checked before narrowing, which would cut a wider tensor to fit
            raise ValueError(f"expert {('gate', 'up')[shard_id] if self.fused_gate_up else 'down'} weight has shape "
                             f"{tuple(loaded.shape)}, the model expects {expected}")
        if self.fused_gate_up:  # rows [shard * I, (shard + 1) * I) take this rank's rows of gate or up
            size = param.shape[0] // 2
            rows = slice(shard_id * size, (shard_id + 1) * size)
            part = (slice(self.tp.rank * size, (self.tp.rank + 1) * size), slice(0, loaded.shape[1]))
            loaded = loaded.narrow(0, self.tp.rank * size, size)
        else:  # down_proj: this rank's columns
            rows, size = slice(None), param.shape[1]
            part = (slice(0, loaded.shape[0]), slice(self.tp.rank * size, (self.tp.rank + 1) * size))
            loaded = loaded.narrow(1, self.tp.rank * size, size)
        target = param.data[rows]
        if self.online_scales is not None:  # this rank's part of the blocks one process makes, as a linear layer's
            loaded, self.online_scales[rows] = quantize_online_slice(whole, *part, self.fp8.block)
        target.copy_(loaded)


class _Expert(nn.Module):
    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, tp: TensorParallel, fp8=None, s13=None, s2=None):
        super().__init__()
        self.gate_up_proj = _ExpertProjection(w13, tp, True, fp8, s13)
        self.down_proj = _ExpertProjection(w2, tp, False, fp8, s2)


class _ExpertBlocksProjection(nn.Module):
    """One expert's gate_up_proj or down_proj while the layer keeps blocks: a placeholder parameter whose loader
    hands the checkpoint tensor (blocks or floats) to the layer's collector."""

    def __init__(self, collector: ExpertBlockCollector, expert: int, fused_gate_up: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.takes_ggml_blocks = True
        self.collector, self.expert, self.fused_gate_up = collector, expert, fused_gate_up

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        part = ("gate", "up")[shard_id] if self.fused_gate_up else "down"
        self.collector.load(part, self.expert, loaded)


class _ExpertOfBlocks(nn.Module):
    def __init__(self, collector: ExpertBlockCollector, expert: int):
        super().__init__()
        self.gate_up_proj = _ExpertBlocksProjection(collector, expert, fused_gate_up=True)
        self.down_proj = _ExpertBlocksProjection(collector, expert, fused_gate_up=False)


def _drop(param: nn.Parameter, loaded, shard_id=None) -> None:
    """Another rank's expert (expert parallelism): nothing of it is kept here."""


class _OtherRanksExpert(nn.Module):
    """An expert another rank holds: empty placeholders (an FP8 checkpoint's scales too), so that the checkpoint
    still has to provide it (as on one rank) and its tensors are dropped as they load."""

    def __init__(self, fp8=None):
        super().__init__()
        for name in ("gate_up_proj", "down_proj"):
            proj = nn.Module()
            proj.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            proj.weight.weight_loader = _drop
            proj.weight.takes_ggml_blocks = True  # blocks stay a view of the file, never dequantized to be dropped
            if fp8 is not None and not fp8.online:
                scales = nn.Parameter(torch.empty(0), requires_grad=False)
                scales.weight_loader = _drop
                setattr(proj, fp8.scale_name, scales)
            self.add_module(name, proj)


class FusedExperts(nn.Module):
    """The experts of one layer; children "0", "1", ... are the experts as the checkpoint names them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel,
                 linear_method=None):
        """linear_method: the decoder layers' (None: dense); the GGUF method keeps the experts' blocks where the
        kernels run (module docstring)."""
        super().__init__()
        # experts [first_expert, first_expert + num_local_experts) are held here, in local slots 0, 1, ...
        self.expert_parallel = tp.expert_parallel and tp.size > 1  # at one rank the flag changes nothing
        if self.expert_parallel:
            check_expert_split(num_experts, tp.size)
            self.first_expert, self.num_local_experts = local_experts(num_experts, tp)
            inter, split = intermediate_size, TensorParallel()  # whole experts: loaded unsplit
        else:
            if intermediate_size % tp.size:
                raise ConfigError(f"config field moe_intermediate_size ({intermediate_size}) is not divisible by "
                                  f"tensor_parallel_size {tp.size}")
            self.first_expert, self.num_local_experts = 0, num_experts
            inter, split = intermediate_size // tp.size, tp
        self.num_experts, self.tp = num_experts, tp
        self.hidden_size, self.inter, self.split = hidden_size, inter, split
        self.blocks = None  # the stacked blocks ggml_moe runs, once loaded
        self.ops = expert_kernels(linear_method, torch.empty(0).device)  # where the model is being built
        self.fp8 = expert_config(linear_method)  # FP8 experts: e4m3 codes, and their scales s13 / s2 per row
        self.collector = None
        if self.ops is not None:
            self.collector = ExpertBlockCollector(self.num_local_experts, hidden_size, inter, split)
            self.act_levels = activation_levels(torch.get_default_dtype(), this_cpu_tuning())
            self.register_buffer("w13", None, persistent=False)  # made only where the file's experts are float
            self.register_buffer("w2", None, persistent=False)
        self._make_experts()

    def _make_experts(self) -> None:
        """The experts' children and, unless they keep blocks, their stacked weights (and FP8 scales)."""
        local, inter, hidden_size = self.num_local_experts, self.inter, self.hidden_size
        self.fp8_ops = fp8_ops(torch.empty(0).device) if self.fp8 is not None else None
        if self.ops is None:
            dtype = None if self.fp8 is None else E4M3
            self.register_buffer("w13", torch.empty(local, 2 * inter, hidden_size, dtype=dtype), persistent=False)
            self.register_buffer("w2", torch.empty(local, hidden_size, inter, dtype=dtype), persistent=False)
            if self.fp8 is not None:
                group = self.fp8.block[1] if self.fp8.block else None
                self.register_buffer("s13", torch.zeros(local, 2 * inter, -(-hidden_size // group) if group else 1,
                                                        dtype=torch.float32), persistent=False)
                self.register_buffer("s2", torch.zeros(local, hidden_size, -(-inter // group) if group else 1,
                                                       dtype=torch.float32), persistent=False)
        for e in range(self.num_experts):
            slot = e - self.first_expert
            if not 0 <= slot < local:
                self.add_module(str(e), _OtherRanksExpert(self.fp8))
            elif self.ops is not None:
                self.add_module(str(e), _ExpertOfBlocks(self.collector, slot))
            else:
                scales = (None, None) if self.fp8 is None else (self.s13[slot], self.s2[slot])
                self.add_module(str(e), _Expert(self.w13[slot], self.w2[slot], self.split, self.fp8, *scales))

    def checkpoint_named(self, names_of) -> None:
        """Told the names a checkpoint may give its parts (names_of("0.gate_proj"): expert 0's gate_proj, the
        published name first), as the loader tells linear layers theirs: experts an FP8 checkpoint's
        quantization_config leaves unquantized are made dense (quantization/fp8.py, experts_left_dense). Called
        where the model is built, before it loads."""
        if self.fp8 is None:
            return
        projections = [names_of(f"{e}.{proj}") for e in range(self.num_experts)
                       for proj in ("gate_proj", "up_proj", "down_proj")]
        if experts_left_dense(self.fp8, projections):
            self.fp8 = None
            for name in ("s13", "s2"):
                delattr(self, name)
            self._make_experts()

    def process_weights_after_loading(self) -> None:
        """Stack the collected blocks for ggml_moe, or (experts float in the file) fill the dense weights."""
        collector, self.collector = self.collector, None
        if collector is None:
            return
        if not collector.float_in_file():
            self.blocks = collector.stack()
            return
        experts, inter, dtype = collector.num_experts, collector.inter, torch.get_default_dtype()
        self.w13 = torch.empty(experts, 2 * inter, collector.hidden, dtype=dtype)
        self.w2 = torch.empty(experts, collector.hidden, inter, dtype=dtype)
        for e in range(experts):
            self.w13[e, :inter] = collector.dense("gate", e, dtype)
            self.w13[e, inter:] = collector.dense("up", e, dtype)
            self.w2[e] = collector.dense("down", e, dtype)
        collector.loaded.clear()

    def local_pairs(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
        """The (token, slot) pairs whose expert this rank holds (expert parallelism): their tokens [P], local
        expert ids [P, 1] and weights [P, 1], P = every pair routed to a local expert."""
        local = ids - self.first_expert
        pairs = ((local >= 0) & (local < self.num_local_experts)).flatten().nonzero().squeeze(1)
        return pairs // ids.shape[1], local.flatten()[pairs, None], weights.flatten()[pairs, None]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], the router's weights and expert ids [T, k] -> the weighted sum of the chosen experts'
        outputs [T, hidden], summed over the tensor-parallel ranks."""
        if self.expert_parallel:
            tokens, ids, weights = self.local_pairs(weights, ids)
            if self.blocks is not None:
                # one row per local pair (k = 1): ggml_moe runs only this rank's experts, on only their tokens
                out = torch.zeros_like(x)
                if len(tokens):
                    out.index_add_(0, tokens, self.blocks.run(self.ops, x.index_select(0, tokens), weights, ids,
                                                              self.act_levels))
                return self.tp.all_reduce(out)
            return self.tp.all_reduce(self._dense(x, weights, ids, tokens))
        if self.blocks is not None:
            return self.tp.all_reduce(self.blocks.run(self.ops, x, weights, ids, self.act_levels))
        return self.tp.all_reduce(self._dense(x, weights, ids, None))

    def _expert_linear(self, weights: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """x through one expert's gate_up or down weights: FP8 experts' codes stay one byte a weight (fp8_linear)."""
        if self.fp8 is None:
            return F.linear(x, weights)
        group = self.fp8.block[1] if self.fp8.block and scales.shape[1] > 1 else weights.shape[1]
        return fp8_linear(self.fp8_ops, weights, scales, group, x)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               tokens: torch.Tensor | None) -> torch.Tensor:
        """The chosen experts in PyTorch, the pairs grouped by expert. tokens: each row of ids' token (None: row
        t of ids is token t's)."""
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]
            start += count
            rows = pairs // ids.shape[1]
            if tokens is not None:
                rows = tokens[rows]
            scales = (None, None) if self.fp8 is None else (self.s13[expert], self.s2[expert])
            gate, up = self._expert_linear(self.w13[expert], scales[0], x[rows]).chunk(2, dim=-1)
            y = self._expert_linear(self.w2[expert], scales[1], F.silu(gate) * up)
            out.index_add_(0, rows, y * weights.flatten()[pairs, None])
        return out

"""A mixture-of-experts layer's experts kept as a GGUF file's blocks and run on them by the ggml_moe kernel
(kernels/cpu/ggml/experts.cpp), under the `gguf` quantization where our CPU kernels run: no expert is ever held
dequantized, and each step reads only the chosen experts' bytes.

Loading: the loader hands over each expert's [rows, row length] blocks of ffn_{gate,up,down}_exps as a view of the
file (GGUFCheckpoint); `ExpertBlockCollector` keeps this rank's part of each (gate and up rows narrowed; down's
columns narrowed, or re-quantized to Q8_0 where the split falls inside blocks, as gguf.py's `_columns`). Once the
layer has all of them, `stack` copies them expert by expert into one uint8 tensor per projection, [experts, rows,
row bytes], each expert's rows in the decode layout (groups of 8, where the rows divide into groups; else the
file's layout), gate and up fused into one tensor when their types match (one kernel call instead of two). An
expert of a type the kernel does not run (not in gguf.py's KERNEL_TYPES: Q2_K, Q3_K, the IQ types, ...) is
re-quantized to Q8_0 on the way, one expert at a time. A layer whose experts the file holds in float (F32, F16,
BF16) stays dense in the run dtype: `stack` returns None and the layer dequantizes them (moe.py)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType

from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.kernels import cpu_ops_for
from qwenserve.model.layers.quantization.ggml_blocks import quantize_q8_0
from qwenserve.model.layers.quantization.gguf import KERNEL_TYPES, GGUFLinearMethod, _columns
from qwenserve.model.loader.ggml_tensor import DECODE_GROUP, GGMLTensor

Q = GGMLQuantizationType
PARTS = ("gate", "up", "down")


def expert_kernels(linear_method, device: torch.device):
    """The kernel library that runs the experts of a layer built with this linear method on `device`, where they
    keep their blocks (the GGUF method, where our CPU kernels run); None where they run dense."""
    return cpu_ops_for(device) if isinstance(linear_method, GGUFLinearMethod) else None


class ExpertBlocks(NamedTuple):
    """One layer's experts as ggml_moe takes them: gate (or gate then up, where `up` is None) [experts, rows, row
    bytes], up, down [experts, hidden, row bytes], their ggml types, and the rows' grouping. A tuple, so that the
    model's weight bytes count it (worker/memory.py)."""
    gate: torch.Tensor
    gate_type: int
    up: torch.Tensor | None
    up_type: int
    down: torch.Tensor
    down_type: int
    group: int

    def run(self, ops, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act_levels: int) -> torch.Tensor:
        """x [T, hidden], the router's weights and expert ids [T, k] -> the weighted sum of the chosen experts'
        outputs [T, hidden] (this rank's part)."""
        return ops.ggml_moe(x.contiguous(), ids.contiguous(), weights.float().contiguous(), self.gate,
                            self.gate_type, self.up, self.up_type, self.down, self.down_type, self.group, act_levels)


class ExpertBlockCollector:
    """Each expert's gate, up and down as loaded (this rank's part), until the layer stacks them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel):
        self.num_experts, self.hidden, self.inter, self.tp = num_experts, hidden_size, intermediate_size, tp
        self.loaded: dict[str, list] = {part: [None] * num_experts for part in PARTS}

    def load(self, part: str, expert: int, loaded) -> None:
        """Keep this rank's rows (gate, up) or columns (down) of one expert's checkpoint tensor: GGMLTensor blocks
        (a view of the file) or a float tensor."""
        size = self.inter
        whole = self.inter * self.tp.size  # every rank reads the whole tensor and keeps its part
        expected = (self.hidden, whole) if part == "down" else (whole, self.hidden)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert {part} weight has shape {tuple(loaded.shape)}, the model expects {expected}")
        if part == "down":
            loaded = _columns(loaded, self.tp.rank * size, size)
        else:
            loaded = loaded.narrow(0, self.tp.rank * size, size)
        self.loaded[part][expert] = loaded

    def float_in_file(self) -> bool:
        """Whether any expert came as floats (the file's F32, F16 or BF16): the layer then runs dense."""
        return any(not isinstance(t, GGMLTensor) or t.ggml_type in (Q.F32, Q.F16, Q.BF16)
                   for part in PARTS for t in self.loaded[part])

    def dense(self, part: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        t = self.loaded[part][expert]
        return t.dequantize(dtype) if isinstance(t, GGMLTensor) else t.to(dtype)

    def stack(self) -> ExpertBlocks:
        """The experts stacked per projection (module docstring); the collected views are let go."""
        group = DECODE_GROUP if self.inter % DECODE_GROUP == 0 and self.hidden % DECODE_GROUP == 0 else 1
        types = {part: _kernel_type(self.loaded[part][0].ggml_type) for part in PARTS}
        fused = types["gate"] == types["up"]
        gate = self._stacked(("gate", "up") if fused else ("gate",), types["gate"], group)
        up = None if fused else self._stacked(("up",), types["up"], group)
        down = self._stacked(("down",), types["down"], group)
        self.loaded = {part: [] for part in PARTS}
        return ExpertBlocks(gate, int(types["gate"]), up, int(types["up"]), down, int(types["down"]), group)

    def _stacked(self, parts: tuple[str, ...], ggml_type: Q, group: int) -> torch.Tensor:
        """uint8 [experts, rows of `parts` one after the other, row bytes], copied one expert at a time."""
        out = None
        for e in range(self.num_experts):
            blocks = [_as_type(self.loaded[part][e], ggml_type) for part in parts]
            if out is None:
                rows = sum(b.shape[0] for b in blocks)
                out = torch.empty(self.num_experts, rows, blocks[0].raw.shape[1], dtype=torch.uint8)
            start = 0
            for b in blocks:
                laid_out = b.grouped() if group != 1 else b.in_file_layout()
                out[e, start:start + b.shape[0]] = laid_out.raw
                start += b.shape[0]
        return out


def _kernel_type(ggml_type: Q) -> Q:
    """The type an expert runs in: its own where the kernel runs it, else Q8_0."""
    return ggml_type if ggml_type in KERNEL_TYPES else Q.Q8_0


def _as_type(blocks: GGMLTensor, ggml_type: Q) -> GGMLTensor:
    if blocks.ggml_type == ggml_type:
        return blocks
    if blocks.ggml_type in KERNEL_TYPES:
        raise ValueError(f"experts of one projection mix ggml types {blocks.ggml_type.name} and {ggml_type.name}")
    return quantize_q8_0(blocks.dequantize())

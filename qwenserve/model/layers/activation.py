import torch
import torch.nn.functional as F

from qwenserve.model.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """[..., 2d] (gate, up) -> silu(gate) * up, [..., d]."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        self.ops.silu_and_mul(out, x)
        return out

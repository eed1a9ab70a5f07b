from __future__ import annotations

import torch
from torch import nn

from qwenserve.model.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """RMSNorm, optionally fused with the residual add that precedes it (vLLM's convention).

    forward(x) -> norm(x); forward(x, residual) -> (norm(x + residual), x + residual). With the CPU kernels
    the second form works in place: x and residual are overwritten with the two results, so callers pass
    tensors they no longer need."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in float32 whatever the run dtype, as the reference implementation does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        x = x.contiguous()
        if residual is None:
            out = torch.empty_like(x)
            self.ops.rms_norm(out, x, self.weight, self.eps)
            return out
        residual = residual.contiguous()
        self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

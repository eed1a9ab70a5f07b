"""A layer with two implementations of the same computation: plain PyTorch ops (`forward_native`, runs
anywhere) and our compiled CPU kernel (`forward_cpu`). Which one runs is chosen once, when the layer is
built, from the device the model is being built on (the `torch.device(...)` context) and whether the kernels
are available (`qwenserve.kernels.disabled()`, QWENSERVE_CPU_KERNELS=0, no compiler); never per call."""
from __future__ import annotations

import torch
from torch import nn

from qwenserve.kernels import cpu_ops_for


class CustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.ops = cpu_ops_for(torch.empty(0).device)  # the chosen variant's torch.ops namespace, or None
        self._forward = self.forward_cpu if self.ops is not None else self.forward_native

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        raise NotImplementedError

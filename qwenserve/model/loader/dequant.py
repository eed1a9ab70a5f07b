"""Dequantization of ggml block formats to float32 torch tensors.

The formats in common Qwen GGUF files (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) are written here
as vectorised torch ops, several times faster than gguf's numpy reference on 2 cores; any other format falls
back to `gguf.quants.dequantize`. Tests check every torch path against that reference.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

Q = GGMLQuantizationType
QK_K = 256


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale stored at byte `start` of every block, as a float32 column."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _low_high_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: all low nibbles, then all high nibbles (ggml's order)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return (_low_high_nibbles(b[:, 2:]).float() - 8.0) * _f16(b, 0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _low_high_nibbles(b[:, 4:]).float() * _f16(b, 0) + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # 32 fifth bits in 4 bytes, little-endian: bit j lives in byte j // 8
    shifts = torch.arange(8, dtype=torch.uint8)
    fifth = ((b[:, 2:6].unsqueeze(-1) >> shifts) & 1).reshape(-1, 32)
    q = _low_high_nibbles(b[:, 6:]) | (fifth << 4)
    return (q.float() - 16.0) * _f16(b, 0)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins packed in 12 bytes."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scales.float(), mins.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, mins = _k_scales_mins(b[:, 4:16])
    d = (_f16(b, 0) * scales).unsqueeze(-1)  # [n, 8, 1]
    dmin = (_f16(b, 2) * mins).unsqueeze(-1)
    # 4 chunks of 32 bytes, each holding two 32-value sub-blocks (low nibbles first)
    q = _low_high_nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (d * q - dmin).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    # each 128-value half: 64 bytes of low nibbles, 32 bytes holding the two high bits of four groups
    low = _low_high_nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & 0x03
    q = (low | (high << 4)).to(torch.int8).float() - 32.0  # [n, 2, 4, 32]
    scales = b[:, 192:208].view(torch.int8).float().reshape(n, 16, 1)
    d = _f16(b, 208).unsqueeze(-1) * scales  # [n, 16, 1]
    return (d * q.reshape(n, 16, 16)).reshape(n, QK_K)


_BLOCK_DEQUANTIZERS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q4_K: _q4_k,
                       Q.Q6_K: _q6_k}


def dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes of one ggml tensor -> a float32 tensor of `shape` (torch order)."""
    data = torch.from_numpy(raw)
    if ggml_type == Q.F32:
        return data.view(torch.float32).reshape(shape).clone()
    if ggml_type == Q.F16:
        return data.view(torch.float16).reshape(shape).float()
    if ggml_type == Q.BF16:
        return data.view(torch.bfloat16).reshape(shape).float()
    fn = _BLOCK_DEQUANTIZERS.get(ggml_type)
    if fn is None:  # rarer formats: the gguf package's numpy reference
        return torch.from_numpy(quants.dequantize(np.asarray(raw), ggml_type)).reshape(shape).float()
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    return fn(data.reshape(-1, block_bytes)).reshape(shape)

"""`qwenserve bench shaped-gguf`: Qwen2.5-1.5B-, 3B- and 7B-shaped, Qwen3-1.7B- and 8B-shaped and the
mixture-of-experts Qwen3-30B-A3B- and Qwen1.5-MoE-A2.7B-shaped GGUF files with random weights, in the type mix
llama.cpp's quantizer gives LLAMA_FTYPE_MOSTLY_Q4_K_M, for timing only (their text is noise). `layers` (--layers)
writes only the first N decoder layers, for quick runs.

The shapes are those of the published Qwen2.5, Qwen3, Qwen3-MoE and Qwen1.5-MoE config.json files. A Qwen3 file
(general.architecture qwen3) has no q/k/v biases, a per-head RMSNorm weight for queries and keys in each layer
(attn_q_norm, attn_k_norm, F32) and its head width as qwen3.attention.key_length / value_length. The tokenizer and
the rest of the metadata are copied from another GGUF file (the bundled model by default): every key but the shape
keys and the name keys, the source's architecture keys renamed to the shape's.

A mixture-of-experts file (qwen3moe: Qwen3's attention; qwen2moe: Qwen2's, with q/k/v biases) has in every layer a
router (ffn_gate_inp.weight, [experts, hidden], F32: llama.cpp never quantizes it), the experts stacked in 3-D
tensors (ffn_gate_exps and ffn_up_exps [experts, expert FFN, hidden], ffn_down_exps [experts, hidden, expert FFN])
and, for qwen2moe, a shared expert (ffn_{gate,up,down}_shexp) with its sigmoid gate (ffn_gate_inp_shexp.weight,
[hidden], F32). The router weights are random, so each token's top-k experts are close to a uniform draw: every
expert is used about equally often and a batch touches nearly all of them. That is the expensive case for anything
that caches or prefetches experts (a trained router's preferences would make it cheaper), so timings here bound it
from the slow side.

The type of each tensor follows llama.cpp's quantizer (`src/llama-quant.cpp`, `llama_tensor_get_type_impl`,
reached through `llama_tensor_get_type` for each tensor it may quantize):
- every 2-D weight starts at the file type's default, Q4_K; 1-D tensors (norms, biases) stay F32;
- `attn_v.weight` and `ffn_down.weight` get Q6_K on the layers its `use_more_bits(i, n)` picks: i < n/8, or
  i >= 7n/8, or (i - n/8) % 3 == 2 (integer division). The counters it passes are the tensor's position among
  the model's attn_v (or ffn_down) tensors, which its loader sorts by layer number, so i is the layer index and n
  the layer count. Its attn_v branch for Q4_K_M has no GQA condition (the `n_gqa() >= 4` tests belong to the
  Q2_K, Q2_K_S, IQ3 and IQ4 types), and its 70B and 8-expert overrides do not apply to these shapes (128 and 60
  experts);
- the category is a substring of the name, so `ffn_down_exps` and `ffn_down_shexp` are ffn_down tensors: with
  experts (n_expert > 1) the layer i is parsed from the name and n is the model's layer count, so both get Q6_K
  on the same layers as a dense ffn_down; gate and up (exps and shexp) keep Q4_K;
- `ffn_gate_inp.weight` (the router) is never quantized, and 1-D tensors (`ffn_gate_inp_shexp.weight` too) stay
  F32;
- `output.weight` gets Q6_K (its row length is a multiple of 256, and Q4_K is not Q8_0);
- `token_embd.weight` keeps Q4_K in an untied model, but where the model has no `output.weight` the quantizer
  sets `has_tied_embeddings` (in `init_quantize_state_counters`) and gives the embedding the output tensor's
  type: Q6_K, as for the 1.5B and 3B shapes here;
- a row length (ne[0], the last dimension in torch order) that is not a multiple of 256 falls back (Q4_K to
  Q5_0, Q6_K to Q8_0, both in blocks of 32). Only the experts' FFN widths may be such here (Qwen1.5-MoE's 1408:
  its ffn_down_exps are Q5_0, Q8_0 on the more-bits layers); they must be multiples of 32 (else llama.cpp would
  go on to F16), and the hidden size, the heads' width and a dense FFN must be multiples of 256.

The blocks are random but valid: Q4_K with per-sub-block minimums that centre each sub-block on zero, Q6_K with
positive sub-block scales, Q5_0 and Q8_0 with uniform codes, and fp16 block scales set so that the weights' standard
deviation is about 0.02 (that of a trained model's), which keeps activations finite through every layer. A seed
fixes every byte.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

from qwenserve.model.loader.gguf_file import GGUFFile

Q4_K, Q6_K, F32 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.F32
Q5_0, Q8_0 = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0
QK_K = 256  # weights per K-quant block
QK_FALLBACK = 32  # weights per Q5_0 / Q8_0 block, the fallback types
# llama.cpp's tensor_type_fallback for a row length that is not a multiple of QK_K
_FALLBACK = {Q4_K: Q5_0, Q6_K: Q8_0}
WEIGHT_STD = 0.02
SOURCE_ARCH = "qwen2"  # the tokenizer file's architecture (the bundled model's)


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2, Qwen3, Qwen2-MoE or Qwen3-MoE decoder's shape; the vocabulary is the tokenizer's."""
    size_label: str  # general.size_label, e.g. "1.5B"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tied_embeddings: bool  # no output.weight: the LM head is the embedding
    context_length: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    architecture: str = "qwen2"  # general.architecture: qwen2, qwen3, qwen2moe or qwen3moe
    explicit_head_dim: int | None = None  # Qwen3's head_dim; None: hidden_size / num_heads
    # mixture of experts only (0 for a dense shape); intermediate_size is then metadata only (no dense FFN)
    num_experts: int = 0
    num_experts_used: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # qwen2moe's shared expert

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"shape architecture must be one of {', '.join(ARCHITECTURES)}, got "
                             f"{self.architecture!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "context_length"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"shape {name} must be a positive integer, got {getattr(self, name)!r}")
        self._check_experts()
        # the dense FFN's rows are tensors only in a dense shape; the experts' widths may fall back (_check_experts)
        for name in ("hidden_size",) if self.is_moe else ("hidden_size", "intermediate_size"):
            if getattr(self, name) % QK_K:
                raise ValueError(f"shape {name} {getattr(self, name)} is not a multiple of {QK_K}: its rows would not "
                                 "be whole Q4_K/Q6_K blocks (llama.cpp would fall back to other types)")
        if self.explicit_head_dim is None and (self.hidden_size % self.num_heads or
                                               (self.hidden_size // self.num_heads) % 2):
            raise ValueError(f"shape hidden_size {self.hidden_size} does not split into {self.num_heads} heads of an "
                             "even size")
        if self.explicit_head_dim is not None and (self.explicit_head_dim % 2 or self.q_size % QK_K):
            raise ValueError(f"shape head_dim {self.explicit_head_dim} must be even, and heads x head_dim a "
                             f"multiple of {QK_K}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"shape num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")

    def _check_experts(self) -> None:
        moe_fields = ("num_experts", "num_experts_used", "expert_intermediate_size",
                      "shared_expert_intermediate_size")
        if not self.is_moe:
            if any(getattr(self, name) for name in moe_fields):
                raise ValueError(f"a {self.architecture} shape has no experts: {', '.join(moe_fields)} must be 0")
            return
        widths = ("expert_intermediate_size",) + (("shared_expert_intermediate_size",) if self.has_shared_expert
                                                  else ())
        for name in ("num_experts", "num_experts_used") + widths:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"shape {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_experts_used > self.num_experts:
            raise ValueError(f"shape num_experts_used {self.num_experts_used} exceeds num_experts {self.num_experts}")
        if not self.has_shared_expert and self.shared_expert_intermediate_size:
            raise ValueError(f"a {self.architecture} shape has no shared expert: shared_expert_intermediate_size "
                             "must be 0")
        for name in widths:  # a row length off QK_K falls back to Q5_0/Q8_0, whose blocks must still fit
            if getattr(self, name) % QK_FALLBACK:
                raise ValueError(f"shape {name} {getattr(self, name)} is not a multiple of {QK_FALLBACK}: its rows "
                                 "would be whole blocks of neither Q4_K/Q6_K nor their fallbacks Q5_0/Q8_0")

    @property
    def is_moe(self) -> bool:
        return self.architecture in ("qwen2moe", "qwen3moe")

    @property
    def has_shared_expert(self) -> bool:
        return self.architecture == "qwen2moe"

    @property
    def qkv_bias(self) -> bool:  # Qwen2's attention; Qwen3's has per-head q/k norms instead
        return self.architecture in ("qwen2", "qwen2moe")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def family(self) -> str:
        return {"qwen2": "Qwen2.5", "qwen3": "Qwen3", "qwen2moe": "Qwen1.5-MoE",
                "qwen3moe": "Qwen3-MoE"}[self.architecture]


ARCHITECTURES = ("qwen2", "qwen3", "qwen2moe", "qwen3moe")

# from the published Qwen2.5, Qwen3, Qwen3-30B-A3B and Qwen1.5-MoE-A2.7B config.json files
SHAPES = {
    "1.5b": ModelShape("1.5B", 1536, 28, 12, 2, 8960, tied_embeddings=True),
    "3b": ModelShape("3B", 2048, 36, 16, 2, 11008, tied_embeddings=True),
    "7b": ModelShape("7B", 3584, 28, 28, 4, 18944, tied_embeddings=False),
    "qwen3-1.7b": ModelShape("1.7B", 2048, 28, 16, 8, 6144, tied_embeddings=True, context_length=40960,
                             architecture="qwen3", explicit_head_dim=128),
    "qwen3-8b": ModelShape("8B", 4096, 36, 32, 8, 12288, tied_embeddings=False, context_length=40960,
                           architecture="qwen3", explicit_head_dim=128),
    "qwen3-30b-a3b": ModelShape("30B-A3B", 2048, 48, 32, 4, 6144, tied_embeddings=False, context_length=40960,
                                architecture="qwen3moe", explicit_head_dim=128, num_experts=128, num_experts_used=8,
                                expert_intermediate_size=768),
    "qwen1.5-moe-a2.7b": ModelShape("A2.7B", 2048, 24, 16, 16, 5632, tied_embeddings=False, context_length=8192,
                                    architecture="qwen2moe", num_experts=60, num_experts_used=4,
                                    expert_intermediate_size=1408, shared_expert_intermediate_size=5632),
}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # torch order: (rows, row length), (experts, rows, row length) or (length,)
    ggml_type: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block_elems, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block_elems * block_bytes


def gets_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third one between."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def q4_k_m_type(name: str, num_layers: int, tied_embeddings: bool, row_length: int = QK_K) -> GGMLQuantizationType:
    """The type llama.cpp's quantizer gives a 2-D or 3-D weight of a Qwen model in a Q4_K_M file (module
    docstring); row_length: the tensor's ne[0], for the fallback."""
    if name == "output.weight" or (name == "token_embd.weight" and tied_embeddings):
        chosen = Q6_K
    else:
        # ffn_down_exps and ffn_down_shexp match too: llama.cpp's category is a substring of the name
        match = re.fullmatch(r"blk\.(\d+)\.(attn_v|ffn_down(?:_exps|_shexp)?)\.weight", name)
        chosen = Q6_K if match and gets_more_bits(int(match.group(1)), num_layers) else Q4_K
    return _FALLBACK[chosen] if row_length % QK_K else chosen


def tensor_plan(shape: ModelShape, vocab_size: int) -> list[PlannedTensor]:
    """Every tensor of the file in the order written, the bundled file's: the LM head (untied only), the
    embedding, each layer's tensors by name, the final norm."""
    h, q, kv = shape.hidden_size, shape.q_size, shape.num_kv_heads * shape.head_dim
    biased = shape.qkv_bias

    def weight(name: str, *dims: int) -> PlannedTensor:
        return PlannedTensor(name, dims, q4_k_m_type(name, shape.num_layers, shape.tied_embeddings, dims[-1]))

    def ffn(i: int) -> list[PlannedTensor]:
        if not shape.is_moe:
            ff = shape.intermediate_size
            return [weight(f"blk.{i}.ffn_down.weight", h, ff), weight(f"blk.{i}.ffn_gate.weight", ff, h),
                    weight(f"blk.{i}.ffn_up.weight", ff, h)]
        n, ff, sh = shape.num_experts, shape.expert_intermediate_size, shape.shared_expert_intermediate_size
        return [
            PlannedTensor(f"blk.{i}.ffn_gate_inp.weight", (n, h), F32),  # the router: never quantized
            weight(f"blk.{i}.ffn_down_exps.weight", n, h, ff),
            weight(f"blk.{i}.ffn_gate_exps.weight", n, ff, h),
            weight(f"blk.{i}.ffn_up_exps.weight", n, ff, h),
            *([weight(f"blk.{i}.ffn_down_shexp.weight", h, sh), weight(f"blk.{i}.ffn_gate_shexp.weight", sh, h),
               weight(f"blk.{i}.ffn_up_shexp.weight", sh, h),
               PlannedTensor(f"blk.{i}.ffn_gate_inp_shexp.weight", (h,), F32)] if shape.has_shared_expert else []),
        ]

    plan = [] if shape.tied_embeddings else [weight("output.weight", vocab_size, h)]
    plan.append(weight("token_embd.weight", vocab_size, h))
    for i in range(shape.num_layers):
        layer = [
            PlannedTensor(f"blk.{i}.attn_norm.weight", (h,), F32),
            *ffn(i),
            PlannedTensor(f"blk.{i}.ffn_norm.weight", (h,), F32),
            *([PlannedTensor(f"blk.{i}.attn_k.bias", (kv,), F32)] if biased else []),
            weight(f"blk.{i}.attn_k.weight", kv, h),
            *([] if biased else [PlannedTensor(f"blk.{i}.attn_k_norm.weight", (shape.head_dim,), F32)]),
            weight(f"blk.{i}.attn_output.weight", h, q),
            *([PlannedTensor(f"blk.{i}.attn_q.bias", (q,), F32)] if biased else []),
            weight(f"blk.{i}.attn_q.weight", q, h),
            *([] if biased else [PlannedTensor(f"blk.{i}.attn_q_norm.weight", (shape.head_dim,), F32)]),
            *([PlannedTensor(f"blk.{i}.attn_v.bias", (kv,), F32)] if biased else []),
            weight(f"blk.{i}.attn_v.weight", kv, h),
        ]
        plan.extend(layer)
    plan.append(PlannedTensor("output_norm.weight", (h,), F32))
    return plan


# Random blocks. Each block's fp16 scale d is a base times a jitter drawn from [1 - JITTER, 1 + JITTER]; the base
# is WEIGHT_STD over the root mean square, in units of d, of the weights the random codes and sub-block scales give.
_JITTER = 0.25
_JITTER_MEAN_SQUARE = 1 + _JITTER ** 2 / 3


def _uniform_mean_square(low: int, high: int) -> float:
    """E[x^2] for x uniform over the integers low..high."""
    values = np.arange(low, high + 1, dtype=np.float64)
    return float(np.mean(values ** 2))


# Q4_K: w = d * scale * q - dmin * min per sub-block of 32, q in 0..15, 6-bit scale and min. With dmin = 8 d and
# min = round(15 scale / 16), d * scale * 7.5 - dmin * min is within 4 d of zero: each sub-block is centred.
_Q4_K_SCALES = (32, 63)
_Q4_K_DMIN_RATIO = 8
_Q4_K_MEAN_SQUARE = (_uniform_mean_square(*_Q4_K_SCALES) * (16 ** 2 - 1) / 12  # scale * (q - 7.5)
                     + _Q4_K_DMIN_RATIO ** 2 / 12)  # the rounding of the minimum, uniform within half a step
_Q4_K_D = WEIGHT_STD / math.sqrt(_Q4_K_MEAN_SQUARE * _JITTER_MEAN_SQUARE)

# Q6_K: w = d * scale * (q - 32) per sub-block of 16, q in 0..63, scale an int8 (positive here).
_Q6_K_SCALES = (8, 15)
_Q6_K_MEAN_SQUARE = _uniform_mean_square(*_Q6_K_SCALES) * _uniform_mean_square(-32, 31)
_Q6_K_D = WEIGHT_STD / math.sqrt(_Q6_K_MEAN_SQUARE * _JITTER_MEAN_SQUARE)

# Q5_0 (the fallback for Q4_K): w = d * (q - 16) per block of 32, q in 0..31. Q8_0 (for Q6_K): w = d * q, q an int8.
_Q5_0_D = WEIGHT_STD / math.sqrt(_uniform_mean_square(-16, 15) * _JITTER_MEAN_SQUARE)
_Q8_0_D = WEIGHT_STD / math.sqrt(_uniform_mean_square(-128, 127) * _JITTER_MEAN_SQUARE)


def _random_bytes(rng: np.random.Generator, n_blocks: int, width: int) -> np.ndarray:
    """[n_blocks, width] uniform bytes; the bit generator's raw 64-bit words are several times faster than
    Generator.bytes."""
    words = rng.bit_generator.random_raw(-(-n_blocks * width // 8))
    return words.view(np.uint8)[:n_blocks * width].reshape(n_blocks, width)


def _random_small_ints(rng: np.random.Generator, shape: tuple[int, int], low: int, high: int) -> np.ndarray:
    """Uniform uint8 in low..high, where high - low + 1 is a power of two (a mask keeps them uniform)."""
    span = high - low + 1
    assert span & (span - 1) == 0, span
    return (_random_bytes(rng, *shape) & (span - 1)) + low


def _block_scales(rng: np.random.Generator, n_blocks: int, base: float) -> np.ndarray:
    jitter = rng.uniform(1 - _JITTER, 1 + _JITTER, n_blocks)
    return (base * jitter).astype(np.float16)


def random_q4_k_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """[n_blocks, 144] uint8: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles."""
    blocks = np.empty((n_blocks, 144), dtype=np.uint8)
    d = _block_scales(rng, n_blocks, _Q4_K_D)
    blocks[:, 0:2] = d.view(np.uint8).reshape(n_blocks, 2)
    blocks[:, 2:4] = (d * np.float16(_Q4_K_DMIN_RATIO)).view(np.uint8).reshape(n_blocks, 2)
    scales = _random_small_ints(rng, (n_blocks, 8), *_Q4_K_SCALES)
    mins = ((scales.astype(np.uint16) * 15 + 8) // 16).astype(np.uint8)  # round(15 scale / 16)
    # sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 split: their low 4
    # bits in bytes 8-11 (scale low nibble, min high nibble), their top 2 bits in the top bits of bytes 0-7
    packed = blocks[:, 4:16]
    packed[:, 0:4] = scales[:, 0:4] | ((scales[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mins[:, 0:4] | ((mins[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (scales[:, 4:8] & 0xF) | ((mins[:, 4:8] & 0xF) << 4)
    blocks[:, 16:] = _random_bytes(rng, n_blocks, 128)
    return blocks


def random_q6_k_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """[n_blocks, 210] uint8: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d."""
    blocks = np.empty((n_blocks, 210), dtype=np.uint8)
    blocks[:, :192] = _random_bytes(rng, n_blocks, 192)
    blocks[:, 192:208] = _random_small_ints(rng, (n_blocks, 16), *_Q6_K_SCALES)
    blocks[:, 208:210] = _block_scales(rng, n_blocks, _Q6_K_D).view(np.uint8).reshape(n_blocks, 2)
    return blocks


def random_q5_0_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """[n_blocks, 22] uint8: fp16 d, 4 bytes of the codes' fifth bits, 16 bytes of low nibbles (any bits are valid
    codes, so random bytes give uniform ones)."""
    blocks = np.empty((n_blocks, 22), dtype=np.uint8)
    blocks[:, 0:2] = _block_scales(rng, n_blocks, _Q5_0_D).view(np.uint8).reshape(n_blocks, 2)
    blocks[:, 2:] = _random_bytes(rng, n_blocks, 20)
    return blocks


def random_q8_0_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """[n_blocks, 34] uint8: fp16 d, 32 int8 codes."""
    blocks = np.empty((n_blocks, 34), dtype=np.uint8)
    blocks[:, 0:2] = _block_scales(rng, n_blocks, _Q8_0_D).view(np.uint8).reshape(n_blocks, 2)
    blocks[:, 2:] = _random_bytes(rng, n_blocks, 32)
    return blocks


_RANDOM_BLOCKS = {Q4_K: random_q4_k_blocks, Q6_K: random_q6_k_blocks, Q5_0: random_q5_0_blocks,
                  Q8_0: random_q8_0_blocks}
_CHUNK_BYTES = 32 << 20  # generated and written at a time: memory stays bounded whatever the tensor


def tensor_bytes(tensor: PlannedTensor, rng: np.random.Generator):
    """The tensor's bytes, in chunks of whole rows."""
    if tensor.ggml_type == F32:
        if tensor.name.endswith("_norm.weight"):
            yield np.ones(tensor.shape, dtype=np.float32).tobytes()
        else:  # the q, k and v biases, the routers and the shared experts' gates
            yield rng.normal(0.0, WEIGHT_STD, tensor.shape).astype(np.float32).tobytes()
        return
    rows, row_length = math.prod(tensor.shape[:-1]), tensor.shape[-1]  # experts' rows follow one another
    block_elems, block_bytes = GGML_QUANT_SIZES[tensor.ggml_type]
    blocks_per_row = row_length // block_elems
    row_bytes = blocks_per_row * block_bytes
    rows_per_chunk = max(1, _CHUNK_BYTES // row_bytes)
    for start in range(0, rows, rows_per_chunk):
        n_rows = min(rows_per_chunk, rows - start)
        yield _RANDOM_BLOCKS[tensor.ggml_type](rng, n_rows * blocks_per_row).tobytes()


# metadata keys that describe the shape or name the model; every other key of the source file is copied
def _own_metadata(shape: ModelShape) -> dict[str, tuple[object, GGUFValueType]]:
    u32, f32, text = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    arch = shape.architecture
    head_width = ({f"{arch}.attention.key_length": (shape.head_dim, u32),
                   f"{arch}.attention.value_length": (shape.head_dim, u32)} if shape.explicit_head_dim else {})
    experts = {f"{arch}.expert_count": (shape.num_experts, u32),
               f"{arch}.expert_used_count": (shape.num_experts_used, u32),
               f"{arch}.expert_feed_forward_length": (shape.expert_intermediate_size, u32)} if shape.is_moe else {}
    if shape.has_shared_expert:
        experts[f"{arch}.expert_shared_feed_forward_length"] = (shape.shared_expert_intermediate_size, u32)
    return {
        "general.name": (f"{shape.family} {shape.size_label} shaped, random weights (for timing only)", text),
        "general.basename": (f"{shape.family}-shaped", text),
        "general.finetune": ("random-weights", text),
        "general.size_label": (shape.size_label, text),
        f"{arch}.block_count": (shape.num_layers, u32),
        f"{arch}.context_length": (shape.context_length, u32),
        f"{arch}.embedding_length": (shape.hidden_size, u32),
        f"{arch}.feed_forward_length": (shape.intermediate_size, u32),
        f"{arch}.attention.head_count": (shape.num_heads, u32),
        f"{arch}.attention.head_count_kv": (shape.num_kv_heads, u32),
        **head_width,
        **experts,
        f"{arch}.rope.freq_base": (shape.rope_theta, f32),
        f"{arch}.attention.layer_norm_rms_epsilon": (shape.rms_norm_eps, f32),
        "general.file_type": (int(LlamaFileType.MOSTLY_Q4_K_M), u32),
    }


def _metadata(shape: ModelShape, source: GGUFFile) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """(key, value, type, array item type) in the source's order, the shape and name keys replaced (or added)."""
    arch = source.metadata.get("general.architecture")
    if arch != SOURCE_ARCH:
        raise ValueError(f"{source.path} is a {arch!r} model; the tokenizer and metadata must come from a "
                         f"{SOURCE_ARCH!r} GGUF file")
    if not source.metadata.get("tokenizer.ggml.tokens"):
        raise ValueError(f"{source.path} has no tokenizer (tokenizer.ggml.tokens) to copy")
    own = _own_metadata(shape)
    out = []
    for key, value in source.metadata.items():
        if key == "general.architecture":
            continue  # GGUFWriter writes it first
        if key.startswith(f"{SOURCE_ARCH}."):  # the source's own architecture keys, under the shape's
            key = f"{shape.architecture}.{key.removeprefix(SOURCE_ARCH + '.')}"
        if key in own:
            value, vtype = own.pop(key)
            out.append((key, value, vtype, None))
        else:
            out.append((key, value, *source.metadata_types[key]))
    out.extend((key, value, vtype, None) for key, (value, vtype) in own.items())
    return out


def with_layers(shape: ModelShape, layers: int | None) -> ModelShape:
    """The shape cut to its first `layers` decoder layers (None: all). The types then follow llama.cpp's rule for
    a model of that many layers, as quantizing such a file would give."""
    if layers is None:
        return shape
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= shape.num_layers:
        raise ValueError(f"--layers must be an integer from 1 to the shape's {shape.num_layers} layers, "
                         f"got {layers!r}")
    return dataclasses.replace(shape, num_layers=layers)


def write_shaped_gguf(shape: ModelShape, output: str, seed: int = 0, tokenizer_gguf: str | None = None,
                      overwrite: bool = False, layers: int | None = None) -> dict:
    """Write `shape` with random Q4_K_M-mix weights to `output`, its tokenizer and metadata layout from
    `tokenizer_gguf` (default: the bundled model); layers: only the first N decoder layers (block_count N).
    Returns the path, size, seconds and tensor counts by type."""
    shape = with_layers(shape, layers)
    if os.path.exists(output) and not overwrite:
        raise FileExistsError(f"{output} exists; pass --overwrite to replace it")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if tokenizer_gguf is None:
        from qwenserve.model.loader.bundled import bundled_model_path
        tokenizer_gguf = bundled_model_path()
    elif not os.path.isfile(tokenizer_gguf):
        raise ValueError(f"--tokenizer-gguf {tokenizer_gguf} is not a file")
    start = time.perf_counter()
    source = GGUFFile(tokenizer_gguf)
    metadata = _metadata(shape, source)
    plan = tensor_plan(shape, vocab_size=len(source.metadata["tokenizer.ggml.tokens"]))
    del source

    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    partial = f"{output}.partial"
    writer = GGUFWriter(partial, shape.architecture)
    try:
        for key, value, vtype, item_type in metadata:
            writer.add_key_value(key, value, vtype, sub_type=item_type)
        for tensor in plan:
            if tensor.ggml_type == F32:
                writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes)
            else:  # declared by its bytes ([..., rows, bytes per row] of uint8), as GGUFWriter takes quantized data
                rows = math.prod(tensor.shape[:-1])
                writer.add_tensor_info(tensor.name, (*tensor.shape[:-1], tensor.nbytes // rows), np.dtype(np.uint8),
                                       tensor.nbytes, raw_dtype=tensor.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        out = writer.fout[0]
        writer.write_padding(out, out.tell())
        seeds = np.random.SeedSequence(seed).spawn(len(plan))  # one stream per tensor
        for tensor, tensor_seed in zip(plan, seeds):
            written = 0
            for chunk in tensor_bytes(tensor, np.random.default_rng(tensor_seed)):
                out.write(chunk)
                written += len(chunk)
            assert written == tensor.nbytes, (tensor.name, written, tensor.nbytes)
            writer.write_padding(out, written)
        writer.close()
        _check_written(partial, plan)
        os.replace(partial, output)
    finally:
        writer.close()
        if os.path.exists(partial):
            os.remove(partial)
    return {"path": output, "shape": dataclasses.asdict(shape), "seed": seed, "bytes": os.path.getsize(output),
            "write_s": round(time.perf_counter() - start, 1),
            "tensor_types": dict(Counter(t.ggml_type.name for t in plan))}


def _check_written(path: str, plan: list[PlannedTensor]) -> None:
    """The file reads back with every planned tensor's name, shape and type, and no more."""
    written = GGUFFile(path).tensors
    got = [(t.name, t.shape, t.ggml_type) for t in written.values()]
    want = [(t.name, t.shape, t.ggml_type) for t in plan]
    if got != want:
        raise RuntimeError(f"{path} does not read back as written: {len(got)} tensors, expected {len(want)}")

"""What the loader, the worker and the model runner may ask of a model: the one seam between a model class and
the rest of the engine. A class with these members, registered in model/registry.py, runs in the engine;
nothing outside the class reaches into its modules.

Construction: `cls(config, max_position, tp, quantization, pp)` (a ModelConfig, the context length, this
process's TensorParallel, the QuantizationScheme, its PipelineParallel), called by the loader with the run
dtype as torch's default dtype and the device as the default device, so parameters are created in both. The
loader then copies each checkpoint tensor (HF names) into `checkpoint_target(name)`, through
`packed_modules_mapping` for fused layers and each parameter's own `weight_loader`, and calls
`process_weights_after_loading(after_each)` once all are in. A tensor checkpoint_target drops (None) goes to the
optional `check_dropped(name, tensor)`, which raises ValueError where dropping it would lose weights.

A mixture-of-experts family has the optional classmethod `expert_layers(config) -> list[int]`: the decoder layers
built with experts in place of a dense MLP, whose gate/up/down projections a LoRA adapter cannot adapt (lora/peft.py
refuses such adapters before any request runs them).

GGUF files (optional members, read by model/loader/checkpoint.py): `gguf_layer_names`, a dict of the family's own
llama.cpp layer tensor names to HF module names ("ffn_gate_inp": "mlp.gate"; "{expert}" in the HF name marks a 3-D
tensor of every expert of the layer, loaded one expert at a time), and the classmethod
`gguf_config_fields(metadata, arch, tensor_names) -> dict`, the family's config fields (ModelConfig.extra, as
config.json would give them) from the file's metadata and the names of its tensors."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from qwenserve.distributed.pipeline import PipelineParallel
from qwenserve.model.layers.attention import AttentionMetadata


@dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache this process's part of the model writes: the worker sizes and allocates it from this."""
    num_layers: int  # attention layers this pipeline stage runs, each with its own cache layer
    num_kv_heads: int  # kv heads this tensor-parallel rank holds
    head_dim: int
    dtype: torch.dtype  # the run dtype: what the cache holds unless kv_cache_dtype stores codes


@runtime_checkable
class CausalLM(Protocol):
    # checkpoint module -> (the fused module that holds it, its shard id), e.g. "q_proj": ("qkv_proj", "q")
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]]
    pp: PipelineParallel  # this process's pipeline stage
    hidden_size: int  # width of the activations one pipeline stage passes to the next
    dtype: torch.dtype  # the run dtype the parameters were created in

    @property
    def device(self) -> torch.device: ...

    def kv_cache_spec(self) -> KVCacheSpec: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """input_ids and positions [T] of a flat batch -> hidden states [T, hidden_size] on the last pipeline
        stage; on the others the pair of [T, hidden_size] tensors the next stage takes as `intermediate`.
        attn_metadata.lora (the step's LoRA adapter batch, or None) goes as the second argument to every call of
        a projection an adapter may target (q/k/v, o, gate/up, down; with LoRA on they are lora/layers.py's
        wrappers); the model only passes it on."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] for the rows of the last stage's hidden states that need them."""

    def checkpoint_target(self, name: str) -> str | None:
        """The parameter name a checkpoint tensor loads into (before packed_modules_mapping), or None when this
        process does not hold it (another pipeline stage's layer, a tied head's copy)."""

    def process_weights_after_loading(self, after_each: Callable[[], None] = lambda: None) -> None:
        """Re-arrange the loaded weights for the kernels that run them (e.g. packing), calling `after_each()`
        after each module's: the loader lets go there of the checkpoint pages just copied, so that the peak
        memory of loading stays near the weights' size instead of twice it."""


@runtime_checkable
class MultiModalCausalLM(CausalLM, Protocol):
    """A model whose prompts may hold images (Qwen2-VL): the runner embeds the step's tokens itself, writes each
    image's rows over its placeholder tokens' and passes the rows as forward's `inputs_embeds`; positions are
    [3, T] multimodal rotary positions (model/layers/rotary.py, `mrope_positions`)."""
    spatial_merge_size: int  # patches merged per side into one token (the grid of image_grid_thw / this)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] input rows (first pipeline stage)."""

    def embed_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The processor's pixel values of images with these (t, h, w) patch grids -> their placeholder rows
        [tokens, hidden], images one after another."""


def is_multimodal(model) -> bool:
    return callable(getattr(model, "embed_images", None))


_METHODS = ("kv_cache_spec", "forward", "compute_logits", "checkpoint_target", "process_weights_after_loading")


def interface_gaps(model_class: type) -> list[str]:
    """The members of CausalLM that model_class lacks (instance attributes such as pp are set by its
    constructor, so only the class-level members are checked)."""
    gaps = [name for name in _METHODS if not callable(getattr(model_class, name, None))]
    if not isinstance(getattr(model_class, "device", None), property):
        gaps.append("device (a property)")
    if not isinstance(getattr(model_class, "packed_modules_mapping", None), dict):
        gaps.append("packed_modules_mapping (a dict; {} when nothing is fused)")
    return gaps

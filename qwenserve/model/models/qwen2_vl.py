"""Qwen2-VL and Qwen2.5-VL: the Qwen2 language model (qwen2.py's layers, so every linear method, quantization and
KV cache dtype applies to it) with multimodal rotary positions, plus a vision tower (qwen2_vl_vision.py) whose
output rows replace the image placeholder tokens' embeddings.

The runner asks the tower for an image's rows once (`embed_images`), embeds the step's tokens (`embed_tokens`),
writes the image rows over the placeholders' and passes the result as `inputs_embeds`; positions are [3, T]
(temporal, height, width; model/layers/rotary.py). The tower lives on the first pipeline stage, beside the
embedding.

Checkpoint names: as published (`model.layers.*`, `visual.*`, `lm_head.*`) or as transformers 5 names the
modules (`model.language_model.*`, `model.visual.*`); both load."""
from __future__ import annotations

import torch

from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import ModelConfig
from qwenserve.distributed.pipeline import PipelineParallel
from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.model.layers.attention import AttentionMetadata
from qwenserve.model.layers.quantization import QuantizationScheme
from qwenserve.model.models.qwen2 import Qwen2ForCausalLM
from qwenserve.model.models.qwen2_vl_vision import Grid, VisionTransformer
from qwenserve.model.registry import MODEL_REGISTRY

# transformers 5's module names -> the published ones
_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


@MODEL_REGISTRY.register("Qwen2_5_VLForConditionalGeneration")
@MODEL_REGISTRY.register("Qwen2VLForConditionalGeneration")
class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Both architectures: config.vision.windowed picks Qwen2.5-VL's tower."""

    def __init__(self, config: ModelConfig, max_position: int, tp: TensorParallel = TensorParallel(),
                 quantization: QuantizationScheme = QuantizationScheme(), pp: PipelineParallel = PipelineParallel()):
        if config.vision is None or config.mrope_section is None:
            raise ConfigError(f"{config.architectures[0]} needs vision_config and rope_scaling.mrope_section in "
                              f"config.json")
        if config.vision.out_hidden_size != config.hidden_size:
            raise ConfigError(f"the vision tower's output width ({config.vision.out_hidden_size}) is not the "
                              f"language model's hidden_size ({config.hidden_size})")
        super().__init__(config, max_position, tp, quantization, pp)
        self.vision = config.vision
        self.spatial_merge_size = config.vision.spatial_merge_size
        # the tower is dense in the run dtype, whatever the language model's quantization
        self.visual = VisionTransformer(config.vision) if pp.is_first else None

    def checkpoint_target(self, name: str) -> str | None:
        for new, published in _RENAMES:
            if name.startswith(new):
                name = published + name[len(new):]
        if name.startswith("visual."):
            if name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
                raise ConfigError(f"{name}: the checkpoint quantizes the vision tower, which qwenserve runs dense; "
                                  f"use a checkpoint whose quantization_config leaves visual.* unquantized")
            return name if self.visual is not None else None
        return super().checkpoint_target(name)

    def checkpoint_names(self, name: str) -> tuple[str, ...]:
        """The names a checkpoint may give module `name` (a quantization config's ignore list names layers so):
        the published one and transformers 5's."""
        for new, published in _RENAMES:
            if name.startswith(published):
                return name, new + name[len(published):]
        return (name,)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embed_images(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """The processor's pixel_values of one or more images -> their placeholder rows [tokens, hidden]."""
        return self.visual(pixels, grids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None):
        """positions: [3, T] (a text-only batch may pass [T]); inputs_embeds: the first stage's input rows with
        images spliced in, or None for token embeddings only."""
        return self.model(input_ids, positions, attn_metadata, intermediate, inputs_embeds)

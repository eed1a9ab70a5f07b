"""An adapter folded into its base model's weights (`qwenserve convert --lora`): each adapted projection's weight
becomes W + scaling * B A, as PEFT's merge_and_unload makes it, so the merged checkpoint answers as the base model
with the adapter does, with no adapter left to serve."""
from __future__ import annotations

import torch

from qwenserve.config.model_config import ModelConfig
from qwenserve.lora.peft import TARGET_MODULES, LoRAAdapterError, load_adapter

NO_RANK_LIMIT = 1 << 30  # merging costs the same whatever the rank: no max_lora_rank applies


def adapter_deltas(path: str, model: ModelConfig) -> dict[str, torch.Tensor]:
    """HF weight name (model.layers.3.self_attn.q_proj.weight) -> what the adapter adds to it: scaling * B A, in
    float32. The adapter is checked against the model as the engine checks it (an error names the problem)."""
    adapter = load_adapter(path, model, NO_RANK_LIMIT)
    scaling = adapter.config.scaling
    return {f"model.layers.{layer}.{TARGET_MODULES[module]}.{module}.weight": (b.float() @ a.float()) * scaling
            for (layer, module), (a, b) in adapter.weights.items()}


def merge(name: str, tensor: torch.Tensor, deltas: dict[str, torch.Tensor], path: str) -> torch.Tensor:
    """The weight `name` with its delta added (in float32; the caller casts), or as it is if not adapted."""
    delta = deltas.get(name)
    if delta is None:
        return tensor
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.shape != delta.shape:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: cannot merge into {name}: the checkpoint holds it "
                               f"quantized or in another shape ({type(tensor).__name__}"
                               f"{tuple(getattr(tensor, 'shape', ()))}), not a dense {tuple(delta.shape)} weight")
    return tensor.float() + delta

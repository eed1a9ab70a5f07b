"""What an engine runs, settled once from its load settings and the checkpoint's metadata.

The engine resolves it (model/loader/resolve.py) before any worker starts and hands it to every worker inside
the EngineConfig (`EngineConfig.resolved_model`). It is plain data, so it pickles into worker processes and Ray
actors, and a worker opens the weights from it without reading or checking the configuration again."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qwenserve.config.model_config import ModelConfig

CHECKPOINT_FORMATS = ("hf", "gguf")


@dataclass(frozen=True)
class ResolvedModel:
    path: str  # the HF directory or the GGUF file
    model_id: str  # the name the server reports
    format: str  # one of CHECKPOINT_FORMATS
    architecture: str  # the registered architecture (model/registry.py) that runs the checkpoint
    model_class: type  # its class (implementing model/interface.py), looked up once, by the engine
    config: ModelConfig
    dtype: torch.dtype  # the run dtype
    max_model_len: int
    quantization: str = "none"  # how the weights are held (model/layers/quantization)
    quantization_config: dict = field(default_factory=dict)  # config.json's, for awq and gptq
    generation_config: dict = field(default_factory=dict)  # generation_config.json, or a GGUF file's EOS
    weight_files: tuple[str, ...] = ()  # the files that hold the weights, in reading order
    preprocessor_config: dict = field(default_factory=dict)  # preprocessor_config.json: a VL model's image settings
    # video_preprocessor_config.json: its video settings; None: absent (videos take preprocessor_config's)
    video_preprocessor_config: dict | None = None

    def __post_init__(self):
        if self.format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint format {self.format!r} is not one of {', '.join(CHECKPOINT_FORMATS)}")

    def stop_token_ids(self, tokenizer) -> set[int]:
        """EOS ids from generation_config, the config and the tokenizer."""
        ids: set[int] = set()
        for value in (self.generation_config.get("eos_token_id"), self.config.eos_token_id, tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
        return ids

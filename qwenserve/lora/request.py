"""Which LoRA adapter a request runs with, as vLLM's LoRARequest names it: plain data, so the scheduler and the
step contract can carry it (each worker loads the adapter from lora_path itself)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # the adapter's name (the server's model id for it)
    lora_int_id: int  # the adapter's identity in the engine: >= 1, one per adapter
    lora_path: str  # a PEFT adapter directory (adapter_config.json, adapter_model.safetensors or .bin)
    base_model_name: str | None = None  # the model the adapter was trained on, as the server lists it

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def cache_salt(self) -> bytes:
        """The extra key of its KV blocks' prefix-cache hashes: an adapter changes every layer's K and V, so its
        blocks may never serve the base model or another adapter."""
        return f"lora:{self.lora_int_id}".encode()

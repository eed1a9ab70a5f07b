"""The adapters an engine has accepted: each checked against the base model once, before the first request that
names it is queued (or when it is added on its own, as the server's load does), and each lora_int_id (and name)
bound to one adapter, since the id keys its KV blocks in the prefix cache.

A removed adapter frees its name for another adapter, never its id: requests admitted before the removal run on
with it, and a new adapter under the same name gets a new id, so it never meets the old one's cached blocks."""
from __future__ import annotations

from qwenserve.config.model_config import ModelConfig
from qwenserve.lora.peft import LoRAAdapterError, check_adapter
from qwenserve.lora.request import LoRARequest


class AdapterRegistry:
    def __init__(self, model_config: ModelConfig, max_lora_rank: int):
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[int, LoRARequest] = {}  # lora_int_id -> the adapter it names
        self.removed: set[int] = set()  # ids of removed adapters: never valid again

    def check(self, request: LoRARequest) -> None:
        """Raise LoRAAdapterError, naming the field or tensor, if the adapter cannot be served or its id or name
        already names another adapter; a failed check leaves nothing behind (the files may be fixed)."""
        if request.lora_int_id in self.removed:
            raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}) was removed")
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise LoRAAdapterError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                                       f"at {known.lora_path!r}, not {request.lora_name!r} at {request.lora_path!r}")
            return
        for other in self.adapters.values():
            if other.lora_name == request.lora_name:
                raise LoRAAdapterError(f"lora_name {request.lora_name!r} already names adapter id "
                                       f"{other.lora_int_id} at {other.lora_path!r}")
        check_adapter(request.lora_path, self.model_config, self.max_lora_rank)
        self.adapters[request.lora_int_id] = request

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its name may then name another); False if the id names none."""
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        self.removed.add(lora_int_id)
        return True

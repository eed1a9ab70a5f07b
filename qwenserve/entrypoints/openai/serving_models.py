"""The served model names: the base model's (--served-model-name) and its LoRA adapters' (--lora-modules, and
those loaded while serving); resolving a request's `model` to one of them, /v1/models, and loading and unloading
adapters (/v1/load_lora_adapter, /v1/unload_lora_adapter)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from qwenserve.config.errors import ConfigError, RequestError
from qwenserve.config.server_config import LoRAModulePath
from qwenserve.entrypoints.openai.serving_engine import APIError
from qwenserve.lora.peft import LoRAAdapterError, load_adapter
from qwenserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str], max_model_len: int, engine=None,
                 lora_modules: tuple[LoRAModulePath, ...] = (), vision: bool = False):
        """engine: the AsyncLLMEngine the adapters are registered with (needed with lora_modules, and to load
        adapters). lora_modules are read whole, checked and registered here: a bad one raises ConfigError naming
        it, before the server listens. vision: the model reads images (a vision-language checkpoint); /v1/models
        says so, and the web UI then offers to attach them."""
        self.names = list(served_model_names)
        self.max_model_len = max_model_len
        self.engine = engine
        self.vision = vision
        self.created = int(time.time())
        self.adapters: dict[str, LoRARequest] = {}  # served name -> its adapter
        # an id is never given twice: the engine keys an adapter's KV blocks by it, and an unloaded adapter's
        # requests may still run
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # loads and unloads one at a time
        for module in lora_modules:
            try:
                request = self._new_request(module.name, module.path, module.base_model_name)
                self._validate(request)
                self._add(request, engine.call_blocking)
            except APIError as e:
                raise ConfigError(f"lora_modules {module.name}={module.path}: {e.message}") from None

    # ---- names ---------------------------------------------------------------------------------------------

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The served name a request asked for (the first base name when it names none) and its adapter (None:
        the base model); an unknown name is a 404."""
        if requested is None or requested in self.names:
            return requested or self.names[0], None
        if requested in self.adapters:
            return requested, self.adapters[requested]
        raise APIError(404, f"The model `{requested}` does not exist. Served models: "
                            f"{', '.join(self.names + list(self.adapters))}", param="model", code="model_not_found")

    def model_name(self, requested: str | None) -> str:
        return self.resolve(requested)[0]

    def show_available_models(self) -> dict:
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "qwenserve",
                  "max_model_len": self.max_model_len, "capabilities": {"vision": self.vision}} for name in self.names]
        # as vLLM lists an adapter: its parent the base model, its root the adapter's directory
        cards += [{"id": name, "object": "model", "created": self.created, "owned_by": "qwenserve",
                   "root": adapter.lora_path, "parent": adapter.base_model_name or self.names[0],
                   "max_model_len": self.max_model_len, "capabilities": {"vision": self.vision}}
                  for name, adapter in self.adapters.items()]
        return {"object": "list", "data": cards}

    # ---- loading and unloading ---------------------------------------------------------------------------

    async def load_lora_adapter(self, name: str, path: str) -> str:
        """Check the adapter fully (its config, and every tensor read) and serve it under name; a bad adapter or
        a name in use is a 400 naming the problem, and changes nothing."""
        async with self._lock:
            request = self._new_request(name, path)
            await asyncio.to_thread(self._validate, request)
            await asyncio.to_thread(self._add, request, self.engine.call_blocking)
        logger.info("LoRA adapter %r loaded from %s (id %d)", name, path, request.lora_int_id)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, name: str) -> str:
        """Stop serving an adapter: new requests naming it get 404; those already admitted run to their end with
        it (their KV blocks and the adapter's weights are freed as they finish and as others need the room)."""
        async with self._lock:
            adapter = self.adapters.get(name)
            if adapter is None:
                raise APIError(400, f"The LoRA adapter '{name}' cannot be found: it is not loaded"
                                    f"{' (it is the base model)' if name in self.names else ''}",
                               param="lora_name", code="lora_adapter_not_found")
            del self.adapters[name]  # first: no request may take it from here on
            await self.engine.call(lambda engine: engine.remove_lora(adapter.lora_int_id))
        logger.info("LoRA adapter %r unloaded (id %d)", name, adapter.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _new_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if self.engine is None or not self.engine.lora_config.enable_lora:
            raise APIError(400, f"cannot serve LoRA adapter {name!r}: the server was started without --enable-lora",
                           param="lora_name")
        if not isinstance(name, str) or not name.strip():
            raise APIError(400, "lora_name must be a non-empty string", param="lora_name")
        if not isinstance(path, str) or not path.strip():
            raise APIError(400, "lora_path must be a non-empty string", param="lora_path")
        if name in self.names:
            raise APIError(400, f"The LoRA adapter name '{name}' is the base model's served name",
                           param="lora_name", code="lora_adapter_exists")
        if name in self.adapters:
            raise APIError(400, f"The LoRA adapter '{name}' has already been loaded (from "
                                f"{self.adapters[name].lora_path}); unload it first", param="lora_name",
                           code="lora_adapter_exists")
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def _validate(self, request: LoRARequest) -> None:
        """Read the whole adapter as a worker will (a truncated tensor fails here, not in a later request)."""
        try:
            load_adapter(request.lora_path, self.engine.model_config, self.engine.lora_config.max_lora_rank)
        except LoRAAdapterError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_lora_adapter") from None

    def _add(self, request: LoRARequest, call_blocking) -> None:
        """Register the adapter with the engine (on its thread, through call_blocking) and serve it."""
        try:
            call_blocking(lambda engine: engine.add_lora(request))
        except RequestError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_lora_adapter") from None
        self.adapters[request.lora_name] = request

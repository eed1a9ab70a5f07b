"""The served model names: resolving a request's `model`, and /v1/models."""
from __future__ import annotations

import time

from qwenserve.entrypoints.openai.serving_engine import APIError


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str], max_model_len: int, vision: bool = False):
        """vision: the model reads images (a vision-language checkpoint); /v1/models says so, and the web UI then
        offers to attach them."""
        self.names = list(served_model_names)
        self.max_model_len = max_model_len
        self.vision = vision
        self.created = int(time.time())

    def model_name(self, requested: str | None) -> str:
        """The served name a request asked for (the first when it names none); an unknown one is a 404."""
        if requested is None or requested in self.names:
            return requested or self.names[0]
        raise APIError(404, f"The model `{requested}` does not exist. Served models: {', '.join(self.names)}",
                       param="model", code="model_not_found")

    def show_available_models(self) -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "qwenserve",
             "max_model_len": self.max_model_len, "capabilities": {"vision": self.vision}} for name in self.names]}

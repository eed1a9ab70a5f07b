"""The built-in model classes; importing each module registers its classes (model/registry.py)."""
from qwenserve.model.models import qwen2, qwen2_moe, qwen2_vl, qwen3, qwen3_moe  # noqa: F401

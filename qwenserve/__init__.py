"""qwenserve: a serving engine for the Qwen2 model family."""
__version__ = "0.1.0"

from qwenserve.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from qwenserve.entrypoints.llm import LLM  # noqa: E402
from qwenserve.lora.request import LoRARequest  # noqa: E402
from qwenserve.sample.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput"]

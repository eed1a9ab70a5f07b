"""qwenserve: a serving engine for the Qwen2 model family."""
__version__ = "0.1.0"

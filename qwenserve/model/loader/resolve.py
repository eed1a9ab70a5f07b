"""Resolve what to run, once per engine, before any worker starts: open the checkpoint's configuration (config.json
or GGUF metadata), check its architecture against the model registry, and settle the run dtype, the context
length and the quantization. The result, a ResolvedModel, is plain data that every worker receives; the
tokenizer is built from it here, for the engine's input and output processing."""
from __future__ import annotations

import dataclasses
import logging

from qwenserve.config.engine_config import LoadConfig
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import resolve_dtype
from qwenserve.config.resolved_model import ResolvedModel
from qwenserve.model.layers.quantization import METHODS, QuantizationScheme, quantization_scheme
from qwenserve.model.loader.checkpoint import Checkpoint, open_checkpoint, reopen_checkpoint
from qwenserve.model.registry import MODEL_REGISTRY

logger = logging.getLogger(__name__)


def resolve_model(load: LoadConfig) -> ResolvedModel:
    checkpoint = open_checkpoint(load.model, load.hf_overrides)
    config = checkpoint.config
    architecture = MODEL_REGISTRY.resolve(config.architectures)
    resolved = ResolvedModel(
        path=checkpoint.path, model_id=checkpoint.model_id, format=checkpoint.format, architecture=architecture,
        model_class=MODEL_REGISTRY.model_class(architecture), config=config,
        dtype=resolve_dtype(load.dtype, config), max_model_len=config.resolve_max_model_len(load.max_model_len),
        quantization=resolve_quantization(load.quantization, checkpoint),
        quantization_config=checkpoint.quantization_config, generation_config=checkpoint.generation_config,
        weight_files=checkpoint.weight_files, preprocessor_config=checkpoint.preprocessor_config,
        video_preprocessor_config=checkpoint.video_preprocessor_config)
    config.log_shape(resolved.dtype, resolved.max_model_len)
    logger.info("architecture: %s; quantization: %s", architecture, resolved.quantization)
    return resolved


def load_tokenizer(resolved: ResolvedModel):
    """The checkpoint's tokenizer: its HF tokenizer files, or the one a GGUF file's metadata describes."""
    return reopen_checkpoint(resolved).tokenizer()


def resolve_quantization(requested: str | None, checkpoint: Checkpoint) -> str:
    """The quantization method to run: the one asked for, else the checkpoint's own (gguf for a GGUF file, the
    quant_method of config.json's quantization_config). What each method runs on is its registry entry's
    (layers/quantization/__init__.py): int8, int4 and fp8 quantize dense weights (or a GGUF file's, dequantized)
    at load; a checkpoint stored by an exclusive method (awq, gptq, fp8, compressed-tensors) runs with it only, an
    FP8 one also with none (its weights dequantized, code x scale)."""
    native = checkpoint.native_quantization
    if native not in METHODS:
        loads = ", ".join(name for name, method in METHODS.items() if method.in_config)
        raise ConfigError(f"{checkpoint.path} holds {native!r}-quantized weights (quantization_config in "
                          f"config.json), which qwenserve does not load; it loads: {loads}")
    choice = native if requested is None else str(requested).lower()
    if choice not in METHODS:
        raise ConfigError(f"quantization {requested!r} is not supported; use one of {', '.join(METHODS)}")
    own = METHODS[choice].own_checkpoints
    if own is not None and native != choice:
        what = "not quantized" if native == "none" else f"{native}-quantized"
        raise ConfigError(own.format(name=choice, path=checkpoint.path, what=what))
    dequantized = choice == "none" and METHODS[native].dequantizes  # the exact reference of an FP8 checkpoint
    if METHODS[native].exclusive and choice != native and not dequantized:
        also = " (or none, on its dequantized weights)" if METHODS[native].dequantizes else ""
        raise ConfigError(f"{checkpoint.path} is a {native.upper()} checkpoint: it runs with quantization "
                          f"{native} only, not {choice}{also}")
    # fails here, not in a worker (a dequantized FP8 checkpoint's scales are read by its own method's config)
    checked_quantization_scheme(native if dequantized else choice, checkpoint.quantization_config, checkpoint.path)
    return choice


def checked_quantization_scheme(quantization: str, quantization_config: dict, path: str) -> QuantizationScheme:
    """The linear methods for a quantization name; a bad quantization_config is a ConfigError naming the file."""
    try:
        return quantization_scheme(quantization, quantization_config)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from e


def resolve_draft_model(load: LoadConfig, draft: str, target: ResolvedModel, target_tokenizer) -> ResolvedModel:
    """The draft checkpoint of speculative_config's draft_model, resolved as the target is (same dtype request, its
    own quantization and context length), and checked against the target: a plain Qwen2 language model whose
    tokenizer is the target's token for token (its proposals are target token ids). Its vocabulary size may
    differ (Qwen2.5-0.5B pads its embeddings to 151936 rows, the larger ones to 152064): the tokenizer decides, and
    a sequence holding an id past the draft's rows decodes without proposals (spec_decode/draft_model.py)."""
    try:
        resolved = resolve_model(dataclasses.replace(load, model=draft, quantization=None, max_model_len=None,
                                                          hf_overrides=None))
    except (ConfigError, ValueError) as e:  # the checkpoint's errors name the target's flag, --model
        why = str(e).removeprefix(f"--model {draft}").lstrip(": ")
        raise ConfigError(f"speculative_config: model {draft!r}: {why}") from None
    if resolved.config.vision is not None or target.config.vision is not None:
        raise ConfigError(f"speculative_config: method 'draft_model' runs with language models only; "
                          f"{(resolved if resolved.config.vision is not None else target).path} has a vision tower")
    draft_tokenizer = load_tokenizer(resolved)
    difference = tokenizer_difference(target_tokenizer, draft_tokenizer)
    if difference:
        raise ConfigError(f"speculative_config: model {draft!r} has another tokenizer than the target model "
                          f"{target.path!r} ({difference}); a draft must share the target's tokenizer")
    return resolved


def tokenizer_difference(a, b) -> str:
    """"" when tokenizers a and b map the same strings to the same ids; else the first difference, in words."""
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    if vocab_a == vocab_b:
        return ""
    if len(vocab_a) != len(vocab_b):
        return f"{len(vocab_b)} tokens against the target's {len(vocab_a)}"
    token = next(t for t in sorted(vocab_a) if vocab_b.get(t) != vocab_a[t])
    return f"token {token!r} is {vocab_b.get(token)} in the draft, {vocab_a[token]} in the target"

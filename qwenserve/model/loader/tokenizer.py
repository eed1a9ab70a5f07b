"""Tokenizers: an HF directory's own files, or one rebuilt from a GGUF file's metadata.

The GGUF path builds the byte-level BPE directly with the `tokenizers` library (about 1 s), instead of
going through transformers' Python GPT2Tokenizer (about 10 s here)."""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

# What Qwen's chat templates (Qwen2, Qwen2.5, Qwen3) end a turn with, and the end of text a model may write
# instead: both end a generation (Qwen's generation_config.json lists both) and let a grammar end
END_OF_TURN = ("<|im_end|>", "<|endoftext|>")

# The split Qwen2's tokenizer.json uses before byte-level BPE (llama.cpp's pre-tokenizer "qwen2")
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


# transformers is imported inside the functions: it takes seconds, and processes that only run the model
# (tensor-parallel workers) never need it.


def load_hf_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load the tokenizer in {path} (tokenizer.json / tokenizer_config.json): {e}") from e


def tokenizer_from_gguf(metadata: dict):
    from transformers import PreTrainedTokenizerFast
    kind, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2'), as Qwen2 uses, "
                         "is supported")
    if pre not in (None, "qwen2"):
        raise ValueError(f"GGUF tokenizer.ggml.pre is {pre!r}; only Qwen2's pre-tokenizer ('qwen2') is supported")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]

    backend = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                            byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(key: str) -> str | None:
        idx = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    context_length = metadata.get(f"{metadata.get('general.architecture')}.context_length", 32768)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=token("eos_token_id"), pad_token=token("padding_token_id"),
        bos_token=None, unk_token=None, chat_template=metadata.get("tokenizer.chat_template"),
        model_max_length=context_length, clean_up_tokenization_spaces=False,
    )


def chat_prompt_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                     tools: list[dict] | None = None, template_kwargs: dict | None = None,
                     continue_final_message: bool = False) -> str:
    """A conversation rendered with the checkpoint's chat template (showing tools, if any); template_kwargs are
    more variables for the template (Qwen3's enable_thinking); continue_final_message leaves the final message
    open (the text ends where its content does) for the answer to continue."""
    if not tokenizer.chat_template:
        raise ValueError("this checkpoint has no chat template, so chat messages cannot be formatted")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools, continue_final_message=continue_final_message,
                                         **(template_kwargs or {}))


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> list[int]:
    """Token ids of chat_prompt_text."""
    text = chat_prompt_text(tokenizer, messages, add_generation_prompt, tools, template_kwargs,
                            continue_final_message)
    return tokenizer.encode(text, add_special_tokens=False)

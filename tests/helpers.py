"""Tiny random Qwen2 checkpoints made with HF transformers: HF directories and GGUF files."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, llama.cpp token types, merges) for a byte-level BPE of `vocab_size` entries."""
    alphabet = byte_alphabet()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = alphabet + merged + SPECIAL_TOKENS
    types = [1] * (len(alphabet) + len(merged)) + [3] * len(SPECIAL_TOKENS)
    assert len(tokens) <= vocab_size
    pad = vocab_size - len(tokens)
    return tokens + [f"[PAD{i}]" for i in range(pad)], types + [5] * pad, merges


def tiny_tokenizer(vocab_size: int):
    from qwenserve.model.loader.tokenizer import tokenizer_from_gguf
    tokens, types, merges = tiny_vocab(vocab_size)
    return tokenizer_from_gguf({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    })


def hf_config(**overrides):
    from transformers import Qwen2Config
    kw = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=False, hidden_act="silu")
    kw.update(overrides)
    rope_scaling = kw.pop("rope_scaling", None)
    rope_params = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
    if rope_scaling:
        rope_params.update(rope_scaling)
    cfg = Qwen2Config(rope_parameters=rope_params, **kw)
    tokens = tiny_vocab(cfg.vocab_size)[0]
    cfg.eos_token_id = tokens.index("<|im_end|>")
    cfg.bos_token_id = tokens.index("<|endoftext|>")
    return cfg


def tiny_hf_model(seed: int = 0, **overrides):
    """A random Qwen2ForCausalLM (float32) with non-trivial norms and biases, so loading them is tested too."""
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(hf_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


def save_hf_dir(model, path: str, max_shard_size: str | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": model.config.eos_token_id, "bos_token_id": model.config.bos_token_id}, f)
    return path


# HF name -> GGUF name, the inverse of qwenserve.checkpoint's table (written out here on purpose: a test
# that imported the mapping under test could not catch a mistake in it).
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def hf_to_gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")  # model.layers.N.<module>.<sub>.weight
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def save_gguf(model, path: str, quant: str = "Q8_0", overrides: dict[str, str] | None = None) -> str:
    """Write `model` as a qwen2 GGUF: 2-D weights quantized to `quant` (or to overrides[part] for a tensor
    whose HF name contains `part`, as llama.cpp's Q4_K_M mixes types), 1-D tensors in F32."""
    import gguf
    cfg = model.config

    def qtype(name: str):
        part = next((p for p in (overrides or {}) if p in name), None)
        return gguf.GGMLQuantizationType[overrides[part] if part else quant]
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tokens, types, merges = tiny_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        data = tensor.float().numpy()
        if data.ndim == 2:
            t = qtype(name)
            w.add_tensor(hf_to_gguf_name(name), gguf.quants.quantize(data, t), raw_dtype=t)
        else:
            w.add_tensor(hf_to_gguf_name(name), np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def record_preemptions(llm) -> list[str]:
    """The request ids the engine's scheduler preempts from now on, in order (the list fills as it runs)."""
    preempted = []
    original = llm.engine.scheduler._preempt

    def spy(seq):
        preempted.append(seq.request_id)
        original(seq)
    llm.engine.scheduler._preempt = spy
    return preempted

"""Greedy decoding in HF transformers and in qwenserve on the same weights and token ids (float32), and
where they part: first diverging token and the largest logit difference over the steps both saw. For a
vision-language checkpoint a prompt may carry images and videos (multi_modal_data): both models take the same
preprocessed pixels (qwenserve's preprocessing, which the tests hold equal to transformers'), so the comparison is
of the towers, the positions and the language model.

An FP8 checkpoint (quant_method fp8 or compressed-tensors) is compared as it is served: qwenserve runs its FP8
weights (float32 activations), HF transformers, which runs no FP8 weights on a CPU, its dequantized reference
(code x scale in float32, written by `qwenserve convert` to a temporary directory); `compare_sides` says which
runs what, and the output repeats it."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

DEFAULT_PROMPTS = [
    "The three primary colors are",
    "长城是中国古代的军事防御工程，它",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    {"messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]},
]


@dataclass
class PromptComparison:
    prompt: str
    equal: bool
    first_divergence: int | None  # index into the generated tokens, None when equal
    max_logit_diff: float  # over the steps up to and including the first divergence
    steps_compared: int
    hf_tokens: list[int]
    qwenserve_tokens: list[int]


def load_prompts(path: str | None) -> list:
    """A JSON list (strings, or {"messages": [...]} for chat) or a text file with one prompt per line."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, (str, dict)) for p in prompts):
            raise ValueError(f"{path}: expected a JSON list of strings or {{\"messages\": [...]}} objects")
        return prompts
    return [line for line in text.splitlines() if line.strip()]


def prompt_ids(tokenizer, prompt) -> tuple[str, list[int]]:
    """A prompt's text (for the table) and token ids: a string, {"messages": [...]} rendered with the chat template
    (string contents), or {"prompt": "..."}; a dict may also hold multi_modal_data, which this leaves alone."""
    from qwenserve.model.loader.tokenizer import chat_prompt_ids
    if isinstance(prompt, dict):
        if "messages" in prompt:
            return json.dumps(prompt["messages"], ensure_ascii=False), chat_prompt_ids(tokenizer, prompt["messages"])
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], tokenizer.encode(prompt["prompt"], add_special_tokens=False)
        raise ValueError(f"prompt object without 'messages' or 'prompt': {prompt}")
    return prompt, tokenizer.encode(prompt, add_special_tokens=False)


def load_hf_model(path: str, vision: bool = False):
    """HF transformers' own Qwen2 (or Qwen2-VL / Qwen2.5-VL, vision) in float32 on the same file qwenserve reads."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if vision:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    if path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(path))
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(hf_model, ids: list[int], max_tokens: int,
              stop_ids: Collection[int] = ()) -> tuple[list[int], list[torch.Tensor]]:
    """HF transformers' greedy continuation of `ids`, one cached step at a time: (the tokens, each step's logits
    in float32). It ends after a token in stop_ids or at max_tokens; with no stop_ids it always runs to
    max_tokens, as a request with ignore_eos does. The tests compare the engine's greedy tokens with it too."""
    out = hf_model(input_ids=torch.tensor([ids]), use_cache=True)
    tokens, logits = [], []
    while True:
        step = out.logits[0, -1].float()
        logits.append(step)
        token = int(step.argmax())
        tokens.append(token)
        if token in stop_ids or len(tokens) == max_tokens:
            return tokens, logits
        # transformers 5 names the KV cache `cache` (it was `past_key_values`)
        out = hf_model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)


@torch.inference_mode()
def hf_greedy_vl(hf_model, ids: list[int], media: list, vision, max_tokens: int,
                 stop_ids: Collection[int] = ()) -> tuple[list[int], list[torch.Tensor]]:
    """hf_greedy for a vision-language model: ids with the placeholders already expanded, media the prompt's
    ImageInputs (core/multimodal.py) in prompt order, a video told by its frames; transformers' generate (which
    keeps the M-RoPE delta between steps) with each step's logits."""
    kwargs: dict = {}
    for kind, pad in (("image", vision.image_token_id), ("video", vision.video_token_id)):
        items = [m for m in media if ids[m.offset] == pad]
        if items:
            prefix = "pixel_values" if kind == "image" else "pixel_values_videos"
            kwargs[prefix] = torch.from_numpy(np.concatenate([m.pixel_values for m in items]))
            kwargs[f"{kind}_grid_thw"] = torch.tensor([list(m.grid) for m in items])
            if kind == "video" and vision.tokens_per_second is not None:  # Qwen2.5-VL: the frames' spacing
                kwargs["second_per_grid_ts"] = torch.tensor([m.time_interval / vision.tokens_per_second
                                                             for m in items])
    types = [{vision.image_token_id: 1, vision.video_token_id: 2}.get(t, 0) for t in ids]
    input_ids = torch.tensor([ids])
    out = hf_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=max_tokens, eos_token_id=list(stop_ids) or None, pad_token_id=0,
                            output_logits=True, return_dict_in_generate=True,
                            mm_token_type_ids=torch.tensor([types]), **kwargs)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [step[0].float() for step in out.logits[:len(tokens)]]


@dataclass(frozen=True)
class CompareSides:
    """What each side of a comparison runs, in words, and the quantization the engine runs."""
    quantization: str  # "none" (the exact path), or an FP8 checkpoint's own method
    qwenserve: str
    hf: str


def compare_sides(model: str | None) -> CompareSides:
    from qwenserve.model.loader.checkpoint import open_checkpoint
    from qwenserve.model.loader.fp8_checkpoint import is_fp8
    checkpoint = open_checkpoint(model)
    if not is_fp8(checkpoint.quantization_config):
        return CompareSides("none", f"{checkpoint.path} in float32 (quantization none: the exact path)",
                            f"{checkpoint.path} in float32")
    method = checkpoint.native_quantization
    return CompareSides(method, f"{checkpoint.path}: its FP8 weights (quantization {method}), float32 activations",
                        "its dequantized reference in float32 (code x scale, written by qwenserve convert)")


@contextlib.contextmanager
def hf_checkpoint(path: str, sides: CompareSides) -> Iterator[str]:
    """The checkpoint HF transformers loads: the engine's own, or an FP8 checkpoint's dequantized reference in a
    temporary directory (removed once HF holds the weights)."""
    if sides.quantization == "none":
        yield path
        return
    from qwenserve.tools.convert import convert
    with tempfile.TemporaryDirectory(prefix="qwenserve-fp8-reference-") as tmp:
        yield convert(path, os.path.join(tmp, "reference"), dtype="float32")


def compare_one(prompt_text: str, hf_tokens, hf_logits, qs_tokens, qs_logits) -> PromptComparison:
    divergence = next((i for i, (a, b) in enumerate(zip(hf_tokens, qs_tokens)) if a != b), None)
    if divergence is None and len(hf_tokens) != len(qs_tokens):
        divergence = min(len(hf_tokens), len(qs_tokens))
    steps = min(len(hf_logits), len(qs_logits)) if divergence is None else min(divergence + 1, len(hf_logits), len(qs_logits))
    diff = max((float((a - b).abs().max()) for a, b in zip(hf_logits[:steps], qs_logits[:steps])), default=0.0)
    return PromptComparison(prompt_text, divergence is None, divergence, diff, steps, hf_tokens, qs_tokens)


def run_compare(model: str | None, prompts: list, max_tokens: int, cpu_kernels: bool = True,
                prepare=None) -> list[PromptComparison]:
    """Each prompt alone through the engine (greedy, float32, logits recorded; cpu_kernels: the setting) and
    through HF transformers. prepare(prompt, engine) -> prompt, if given, first turns a chat prompt's content
    parts into text and multi_modal_data (the CLI's, from entrypoints, which this layer does not import)."""
    from qwenserve.config.engine_config import EngineConfig
    from qwenserve.engine.llm_engine import LLMEngine
    from qwenserve.sample.sampling_params import SamplingParams

    # the exact path (weights dequantized to float32) is what must equal HF; an FP8 checkpoint runs its FP8 weights
    # against HF on their dequantized values
    sides = compare_sides(model)
    engine = LLMEngine(EngineConfig.from_kwargs(model=model, dtype="float32", quantization=sides.quantization,
                                                kv_cache_memory="1GiB", record_logits=True, cpu_kernels=cpu_kernels))
    vision = engine.resolved_model.config.vision
    with hf_checkpoint(engine.resolved_model.path, sides) as hf_path:
        hf_model = load_hf_model(hf_path, vision is not None)
    stop_ids = set(engine.input_processor.eos_token_ids)
    results = []
    for i, prompt in enumerate(prompts):
        prompt = prepare(prompt, engine) if prepare is not None else prompt
        text, ids = prompt_ids(engine.tokenizer, prompt)
        media = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        request = {"prompt_token_ids": ids} | ({"multi_modal_data": media} if media else {})
        processed = engine.input_processor.process(request, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        engine.add_processed_request(f"compare-{i}", processed)
        if vision is None:
            hf_tokens, hf_logits = hf_greedy(hf_model, ids, max_tokens, stop_ids)
        else:  # the prompt with its placeholders expanded and the media preprocessed, as the engine runs them
            hf_tokens, hf_logits = hf_greedy_vl(hf_model, processed.prompt_token_ids, list(processed.images), vision,
                                                max_tokens, stop_ids)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        ours = final.outputs[0]
        results.append(compare_one(text, hf_tokens, hf_logits, ours.token_ids, ours.logits))
    return results


def format_table(results: list[PromptComparison], sides: CompareSides | None = None) -> str:
    lines = [] if sides is None else [f"qwenserve: {sides.qwenserve}", f"HF transformers: {sides.hf}"]
    lines.append(f"{'equal':<6} {'first diff':>10} {'max |dlogit|':>13} {'steps':>5}  prompt")
    for r in results:
        first = "-" if r.first_divergence is None else str(r.first_divergence)
        lines.append(f"{str(r.equal):<6} {first:>10} {r.max_logit_diff:>13.2e} {r.steps_compared:>5}  "
                     f"{r.prompt[:60]!r}")
    return "\n".join(lines)


def results_json(results: list[PromptComparison], sides: CompareSides | None = None) -> str:
    runs = {} if sides is None else {"qwenserve_runs": sides.qwenserve, "hf_runs": sides.hf}
    return json.dumps({"all_equal": all(r.equal for r in results)} | runs | {"prompts": [asdict(r) for r in results]},
                      ensure_ascii=False)

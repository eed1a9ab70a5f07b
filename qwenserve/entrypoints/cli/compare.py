"""`qwenserve compare`: greedy decoding in HF transformers vs qwenserve (float32), token by token."""
from __future__ import annotations

import argparse

from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args, positive_int

MEDIA_FLAGS = ("allowed_local_media_path", "allowed_media_domains")  # where a prompt's image URLs may point


def register(sub) -> None:
    p = sub.add_parser("compare", help="greedy decoding in HF transformers vs qwenserve (float32), token by token; an "
                                       "FP8 checkpoint: its FP8 weights in qwenserve, its dequantized reference in HF")
    add_engine_args(p, only=("model", "cpu_kernels") + MEDIA_FLAGS)
    p.add_argument("--prompts", default=None,
                   help="JSON list (strings or {\"messages\": [...]}, whose contents may hold image_url and "
                        "video_url parts for a vision-language model) or text file, one prompt per line")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from qwenserve.tools.compare import compare_sides, format_table, load_prompts, results_json, run_compare

    config = engine_config_from_args(args)
    load = config.load

    def media_parts(prompt, engine):
        """A chat prompt's image and video parts as placeholders and multi_modal_data (the tools layer takes
        prompts so; splitting parts and fetching media live here, in entrypoints)."""
        from qwenserve.entrypoints.chat_content import load_media, media_placeholders, split_content
        from qwenserve.entrypoints.media import MediaConnector
        if not isinstance(prompt, dict) or "messages" not in prompt:
            return prompt
        placeholders = media_placeholders(engine.tokenizer, engine.resolved_model.config.vision)
        messages, parts = split_content(prompt["messages"], placeholders)
        media = load_media(parts, MediaConnector.from_config(config.multimodal)) if parts else None
        return {"messages": messages} | ({"multi_modal_data": media} if media else {})

    results = run_compare(load.model, load_prompts(args.prompts), args.max_tokens, load.cpu_kernels, media_parts)
    sides = compare_sides(load.model)
    print(results_json(results, sides) if args.json else format_table(results, sides))
    return 0 if all(r.equal for r in results) else 1

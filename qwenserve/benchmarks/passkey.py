"""`qwenserve bench passkey`: a five-digit number hidden at chosen depths of filler text of a chosen length; the
model is asked for it and the share of answers that contain it is the retrieval rate. Each mode is one engine
on the same checkpoint: without DCA, with DCA on a shortened window (chunk_size and
original_max_position_embeddings below the prompt length, so chunks and remapped positions are exercised at
lengths a small machine runs), and with YaRN stretching the same shortened window to the prompt."""
from __future__ import annotations

import gc
import random
import time

from qwenserve.benchmarks.long_context import with_overrides
from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.sample.sampling_params import SamplingParams

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"
MODES = ("no-dca", "dca", "yarn")


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Token ids of about `length` tokens: the intro, filler with the key's sentence at `depth` (0: first,
    1: last) of it, the question."""
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ",
                              add_special_tokens=False)
    head = tokenizer.encode(INTRO, add_special_tokens=False)
    tail = tokenizer.encode(QUESTION, add_special_tokens=False)
    unit = tokenizer.encode(FILLER, add_special_tokens=False)
    room = length - len(head) - len(needle) - len(tail)
    if room <= 0:
        raise ValueError(f"--length {length} leaves no room for filler: the intro, key and question take "
                         f"{length - room} tokens")
    filler = (unit * (room // len(unit) + 1))[:room]
    cut = int(round(depth * room))
    return head + filler[:cut] + needle + filler[cut:] + tail


def mode_overrides(mode: str, window: int, local_size: int, prompt_len: int) -> dict | None:
    if mode == "dca":
        return {"dual_chunk_attention_config": {"chunk_size": window, "local_size": local_size,
                                                "original_max_position_embeddings": window}}
    if mode == "yarn":
        # stretched to a little past the prompt, so the answer fits in max_model_len too
        return {"rope_scaling": {"rope_type": "yarn", "factor": max((prompt_len + 64) / window, 1.0),
                                 "original_max_position_embeddings": window}}
    return None


def bench_passkey(config: EngineConfig, length: int, depths: list[float], trials: int, window: int,
                  local_size: int, modes: list[str], seed: int = 0) -> dict:
    """trials keys at each depth, for each mode; window: DCA's chunk_size and original_max_position_embeddings
    and YaRN's original window (tokens)."""
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"--depths {depths}: each depth must lie in [0, 1] (0: the key first, 1: last)")
    rng = random.Random(seed)
    keys = [[rng.randrange(10000, 100000) for _ in range(trials)] for _ in depths]
    result = {"prompt_len": length, "window": window, "local_size": local_size, "depths": depths,
              "trials_per_depth": trials}
    for mode in modes:
        engine = LLMEngine(with_overrides(config, mode_overrides(mode, window, local_size, length)))
        tokenizer = engine.tokenizer
        found, per_depth, start = 0, [], time.perf_counter()
        for depth, depth_keys in zip(depths, keys):
            hits = 0
            for i, key in enumerate(depth_keys):
                prompt = passkey_prompt(tokenizer, length, depth, key)
                engine.add_request(f"passkey-{depth}-{i}", {"prompt_token_ids": prompt},
                                   SamplingParams(temperature=0.0, max_tokens=8))
                text = ""
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            text = out.outputs[0].text
                hits += str(key) in text
            per_depth.append(round(hits / len(depth_keys), 3))
            found += hits
        result[f"{mode}_retrieval"] = round(found / (len(depths) * trials), 3)
        result[f"{mode}_per_depth"] = per_depth
        result[f"{mode}_seconds"] = round(time.perf_counter() - start, 1)
        del engine
        gc.collect()
    return result

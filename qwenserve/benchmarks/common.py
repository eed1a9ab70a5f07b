"""What the benchmarks share: deterministic token-id workloads, the HF transformers baseline, running a batch
through the engine, and printing a result (a table, and with --json one JSON object as its last line)."""
from __future__ import annotations

import json
import os
import random
import resource
import time

import torch

from qwenserve.sample.sampling_params import SamplingParams


def random_prompts(n: int, length: int | list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts (ordinary tokens only, no special ids)."""
    rng = random.Random(seed)
    lengths = length if isinstance(length, list) else [length] * n
    return [[rng.randrange(vocab) for _ in range(k)] for k in lengths]


def varied_workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n requests, prompt lengths 16-512 and max_tokens 8-256, the same every run."""
    rng = random.Random(seed)
    lengths = [rng.randint(16, 512) for _ in range(n)]
    outputs = [rng.randint(8, 256) for _ in range(n)]
    return random_prompts(n, lengths, vocab, seed + 1), outputs


def ordinary_vocab(tokenizer) -> int:
    """Token ids below the first added (special) token."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return min(added) if added else len(tokenizer)


def peak_rss_gb() -> float:
    """Peak resident memory of this process plus that of each live child (the worker processes of tp / pp)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for pid in _child_pids(os.getpid()):
        try:
            with open(f"/proc/{pid}/status") as f:
                kib += next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            pass  # gone meanwhile
    return round(kib / 1e6, 2)


def _child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:  # not Linux
        return []


def hf_model_like(resolved) -> torch.nn.Module:
    """HF transformers' Qwen2ForCausalLM with exactly the weights qwenserve runs for a ResolvedModel (dequantized,
    same dtype). Built from our checkpoint reader so a GGUF baseline runs plain dense weights, as HF does for an
    HF dir."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qwenserve.model.loader.checkpoint import reopen_checkpoint

    cfg = Qwen2Config(**{k: v for k, v in resolved.config.to_hf_dict().items() if k not in ("architectures",)})
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    state = {name: t.to(resolved.dtype) for name, t in reopen_checkpoint(resolved).weights()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # its buffers are not in the state dict
    return model.to(resolved.dtype).eval()


@torch.inference_mode()
def hf_generate(model, batch: list[list[int]], new_tokens: int, pad_id: int) -> None:
    """One static batch, left padded, every row run to exactly new_tokens."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=pad_id)


def engine_run(engine, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    """All requests submitted at once; returns wall time and per-request first-token times."""
    start = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
    first, done = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start
            done += out.finished
    return {"elapsed_s": time.perf_counter() - start, "ttft_s": first}


def speculation_counters(before: dict, after: dict) -> dict:
    """Speculative decoding between two engine.stats(): drafts proposed (and verified), drafts accepted, the
    acceptance rate, and the mean accepted length (tokens per verification, the target's own one included, as
    vLLM reports it); zeros without speculation."""
    proposed = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    verifications = after["spec_num_drafts"] - before["spec_num_drafts"]
    return {"spec_proposed": proposed, "spec_accepted": accepted, "spec_verifications": verifications,
            "spec_acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
            "spec_mean_accepted_length": round(1 + accepted / verifications, 3) if verifications else 0.0}


def print_result(title: str, result: dict, as_json: bool) -> None:
    print(title)
    for key, value in result.items():
        print(f"  {key:<30} {value}")
    if as_json:
        print(json.dumps(result))

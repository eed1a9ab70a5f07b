"""`qwenserve bench spec-sweep`: output tokens/s with and without speculative decoding at each batch size, and
their ratio, to set `disable_by_batch_size` (the batch size above which speculation stops paying) by
measurement. Each batch size runs the T-like workload (that many requests at once, --input-len random prompt
tokens -> exactly --output-len output tokens, greedy) or the code-edit tasks cycled to that many requests; the
two engines alternate per batch size, so drift on a shared machine hits both alike. Speculation runs at every
batch size here (disable_by_batch_size is lifted): the ratio is what it would pay there."""
from __future__ import annotations

import dataclasses

from qwenserve.benchmarks.code_edit import code_edit_messages, code_edit_tasks
from qwenserve.benchmarks.common import engine_run, ordinary_vocab, random_prompts, speculation_counters
from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.data_parallel import build_engine
from qwenserve.model.loader.tokenizer import chat_prompt_ids


def bench_spec_sweep(config: EngineConfig, batch_sizes: list[int], workload: str, input_len: int,
                     output_len: int) -> dict:
    spec = config.speculative_config
    if spec is None:
        raise ValueError("bench spec-sweep compares speculative decoding with none: give --speculative-config")
    if max(batch_sizes) > config.scheduler.max_num_seqs:
        raise ValueError(f"--batch-sizes up to {max(batch_sizes)} need --max-num-seqs of at least that "
                         f"(it is {config.scheduler.max_num_seqs})")
    plain = build_engine(dataclasses.replace(config, speculative_config=None))
    speculating = build_engine(dataclasses.replace(
        config, speculative_config=dataclasses.replace(spec, disable_by_batch_size=None)))
    vocab = ordinary_vocab(plain.tokenizer)
    if workload == "code-edit":
        tasks = [chat_prompt_ids(plain.tokenizer, code_edit_messages(*task)) for task in code_edit_tasks()]
    result = {"workload": workload, "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
              "output_len": output_len}
    rows = []
    for b in batch_sizes:
        if workload == "code-edit":
            prompts = [tasks[i % len(tasks)] for i in range(b)]
        else:
            prompts = random_prompts(b, input_len, vocab, seed=b)
        # warm-up at the batch's shape on other tokens (one-off costs; no prefix-cache hits for the timed run)
        warm = random_prompts(b, [len(p) for p in prompts], vocab, seed=1000 + b)
        tok_s = {}
        for name, engine in (("off", plain), ("on", speculating)):
            engine_run(engine, warm, [4] * b)
            before = engine.stats()
            run = engine_run(engine, prompts, [output_len] * b)
            tok_s[name] = b * output_len / run["elapsed_s"]
            if name == "on":
                counters = speculation_counters(before, engine.stats())
        ratio = tok_s["on"] / tok_s["off"]
        rows.append(f"{b:>5} {tok_s['off']:>10.1f} {tok_s['on']:>10.1f} {ratio:>7.2f} "
                    f"{counters['spec_acceptance_rate']:>10.2f}")
        result.update({f"b{b}_off_tokens_per_s": round(tok_s["off"], 2), f"b{b}_on_tokens_per_s": round(tok_s["on"], 2),
                       f"b{b}_ratio": round(ratio, 3), f"b{b}_acceptance_rate": counters["spec_acceptance_rate"]})
    print("batch  off tok/s   on tok/s   ratio acceptance")
    print("\n".join(rows))
    return result

"""`qwenserve bench latency --workload code-edit`: a few hundred tokens of Python and an instruction to change a
detail (rename a variable, change a constant), answered by the whole code again with the edit made, as chat
prompts (the tasks ship in data/code_edit.txt). Most of the answer repeats the prompt, the case speculative
decoding is for; the result reports output tokens/s and the speculation counters of the timed run.

Each task runs alone (one request at a time, as `bench latency`), greedy, ending at EOS or --output-len tokens."""
from __future__ import annotations

import time
from pathlib import Path

from qwenserve.benchmarks.common import speculation_counters
from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.data_parallel import build_engine
from qwenserve.model.loader.tokenizer import chat_prompt_ids
from qwenserve.sample.sampling_params import SamplingParams

TASKS = Path(__file__).with_name("data") / "code_edit.txt"
TASK_MARK = "### edit: "
ASK = "Reply with the complete updated code only, in one ```python block."


def code_edit_tasks(path: Path = TASKS) -> list[tuple[str, str]]:
    """(instruction, code) of each task in the file: a task is its "### edit: " line and the lines up to the next
    one; lines starting with "#" before the first task are the file's own comments."""
    tasks: list[tuple[str, list[str]]] = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith(TASK_MARK):
            tasks.append((line[len(TASK_MARK):].strip(), []))
        elif tasks:
            tasks[-1][1].append(line)
    if not tasks:
        raise ValueError(f"{path}: no task (a line starting with {TASK_MARK!r})")
    return [(instruction, "".join(code)) for instruction, code in tasks]


def code_edit_messages(instruction: str, code: str) -> list[dict]:
    return [{"role": "user", "content": f"{instruction} {ASK}\n\n```python\n{code}```"}]


def bench_code_edit(config: EngineConfig, output_len: int) -> dict:
    engine = build_engine(config)
    prompts = [chat_prompt_ids(engine.tokenizer, code_edit_messages(*task)) for task in code_edit_tasks()]
    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    _run_alone(engine, "warm-up", prompts[-1], SamplingParams(temperature=0.0, max_tokens=4))
    before = engine.stats()
    runs = [_run_alone(engine, f"code-edit-{i}", prompt, params) for i, prompt in enumerate(prompts)]
    after = engine.stats()
    n_out = sum(n for _, _, n in runs)
    elapsed = sum(e2e for _, e2e, _ in runs)
    decode_s = sum(e2e - ttft for ttft, e2e, _ in runs)
    spec = config.speculative_config
    return {"workload": "code-edit", "tasks": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": n_out, "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(n_out / elapsed, 2),
            # past each first token: what speculation speeds up
            "decode_tokens_per_s": round((n_out - len(runs)) / decode_s, 2) if decode_s > 0 else 0.0,
            "ttft_ms": round(sum(t for t, _, _ in runs) / len(runs) * 1e3, 1),
            "tpot_ms": round(decode_s / max(n_out - len(runs), 1) * 1e3, 2),
            "speculative_method": spec.method if spec is not None else "off",
            **speculation_counters(before, after),
            "dtype": str(engine.resolved_model.dtype).removeprefix("torch.")}


def _run_alone(engine, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[float, float, int]:
    """One request with nothing beside it: (time to first token, end to end, output tokens)."""
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    first, tokens = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            tokens = len(out.outputs[0].token_ids)
    return first or 0.0, time.perf_counter() - start, tokens

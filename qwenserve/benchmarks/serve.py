"""`qwenserve bench serve`: drive any OpenAI-compatible server with streaming completions and report
throughput and TTFT / TPOT / inter-token latency. Speaks only the public API (token-id prompts,
`ignore_eos` so output lengths are exact on servers that accept it, as vLLM does)."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _percentiles(values: list[float], scale: float = 1e3) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(values)

    def pct(p):
        return round(s[min(len(s) - 1, int(p / 100 * len(s)))] * scale, 2)
    return {"mean": round(sum(s) / len(s) * scale, 2), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


async def _one(client: httpx.AsyncClient, url: str, headers: dict, model: str, prompt: list[int],
               output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last, first, chunks, usage_tokens, itl = start, None, 0, None, []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return RequestResult(False, error=str(data["error"])[:200])
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                if data.get("choices") and data["choices"][0].get("text"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
    except httpx.HTTPError as e:
        return RequestResult(False, error=repr(e)[:200])
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, error="no tokens received")
    return RequestResult(True, first - start, end - start, usage_tokens or chunks, itl)


async def run_bench_serve(base_url: str, num_prompts: int, input_len: int, output_len: int,
                          max_concurrency: int | None, request_rate: float | None, api_key: str | None,
                          model: str | None, seed: int = 0, max_token_id: int = 50000) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    # ordinary token ids of any large vocabulary (max_token_id bounds them for small ones)
    prompts = [[rng.randrange(min(100, max_token_id - 1), max_token_id) for _ in range(input_len)]
               for _ in range(num_prompts)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1024)) as client:
        if model is None:
            r = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        url = base_url.rstrip("/") + "/v1/completions"
        limit = asyncio.Semaphore(max_concurrency or num_prompts)

        async def limited(prompt):
            async with limit:
                return await _one(client, url, headers, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt)))
            if request_rate:  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "model": model, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "max_concurrency": max_concurrency, "request_rate": request_rate, "completed": len(ok),
        "failed": len(results) - len(ok), "elapsed_s": round(elapsed, 3),
        "request_throughput": round(len(ok) / elapsed, 3), "output_throughput": round(out_tokens / elapsed, 2),
        "ttft_ms": _percentiles([r.ttft for r in ok]), "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles([x for r in ok for x in r.itl]), "e2e_ms": _percentiles([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }

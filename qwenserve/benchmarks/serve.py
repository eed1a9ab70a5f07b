"""`qwenserve bench serve`: drive any OpenAI-compatible server with streaming completions and report
throughput and TTFT / TPOT / inter-token latency. Speaks only the public API (token-id prompts,
`ignore_eos` so output lengths are exact on servers that accept it, as vLLM does).

With storm=True (`--storm`) the same valid requests come mixed with clients that leave mid-stream (10%) and
malformed or hostile requests (5%; BAD_REQUESTS), and the result adds how the server held up: valid requests
lost, bad requests answered 4xx. storm_kinds and send_bad_request are the one storm traffic generator (the
storm test drives a server with run_bench_serve too)."""
from __future__ import annotations

import asyncio
import json
import random
import ssl
import time
from dataclasses import dataclass, field

import httpx

from qwenserve.config.server_config import SERVER_DEFAULTS


@dataclass
class RequestResult:
    """ok means, by kind: "valid", it streamed to its end; "disconnect", it left after its first token as planned;
    a bad request (BAD_REQUESTS), it got a 4xx OpenAI-shaped error."""
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    kind: str = "valid"
    status: int | None = None


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
                choice = data["choices"][0] if data.get("choices") else {}
                # a chunk with text, or the last (its text may be empty: a partial character is never sent)
                if choice.get("text") or choice.get("finish_reason"):
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


# ---- the storm: clients that leave mid-stream, and malformed or hostile requests ------------------------------

DISCONNECT_FRACTION, BAD_FRACTION = 0.10, 0.05
DISCONNECT_MAX_TOKENS_FACTOR = 4  # a client that leaves asked for more than it read: it is surely still running
# each must get a 4xx; an unknown *field* is not among them: it is ignored, as OpenAI's API and vLLM ignore it
BAD_REQUESTS = ("n_100000", "invalid_json", "huge_max_tokens", "wrong_types", "unknown_role", "oversized_body")


def storm_kinds(num_requests: int, seed: int = 0) -> list[str]:
    """The storm's mix, the same every run: 10% "disconnect", 5% bad (BAD_REQUESTS in turn), the rest "valid",
    shuffled."""
    kinds = ["disconnect"] * round(num_requests * DISCONNECT_FRACTION)
    kinds += [BAD_REQUESTS[i % len(BAD_REQUESTS)] for i in range(round(num_requests * BAD_FRACTION))]
    kinds += ["valid"] * (num_requests - len(kinds))
    random.Random(seed).shuffle(kinds)
    return kinds


def _bad_body(kind: str, model: str, prompt: list[int]) -> tuple[str, bytes]:
    """(path, body) of one of BAD_REQUESTS but the oversized body."""
    valid = {"model": model, "prompt": prompt, "max_tokens": 4}  # each bad body is this, spoilt
    if kind == "invalid_json":
        return "/v1/completions", json.dumps(valid).encode()[:-3]  # cut off mid-value
    body = {"n_100000": valid | {"n": 100000},  # a fan-out that would fill any queue if admitted
            "huge_max_tokens": valid | {"max_tokens": 10 ** 12},
            "wrong_types": valid | {"prompt": {"text": "x"}, "max_tokens": "lots", "temperature": [1]},
            "unknown_role": {"model": model, "messages": [{"role": "wizard", "content": "x"}]}}[kind]
    return ("/v1/chat/completions" if "messages" in body else "/v1/completions"), json.dumps(body).encode()


def _is_openai_error(body) -> bool:
    return isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict) \
        and {"message", "type", "param", "code"} <= set(body["error"])


def _bad_result(kind: str, status: int | None, content: bytes) -> RequestResult:
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    ok = status is not None and 400 <= status < 500 and _is_openai_error(body)
    return RequestResult(ok, kind=kind, status=status, error="" if ok else f"HTTP {status}: {content[:200]!r}")


async def send_bad_request(client: httpx.AsyncClient, base_url: str, headers: dict, kind: str, model: str,
                           prompt: list[int],
                           max_request_bytes: int = SERVER_DEFAULTS.max_request_bytes) -> RequestResult:
    """One malformed or hostile request; ok if it got a 4xx with an OpenAI-shaped error body."""
    if kind == "oversized_body":
        return await _send_oversized(base_url, headers, max_request_bytes)
    path, content = _bad_body(kind, model, prompt)
    try:
        r = await client.post(base_url + path, content=content, headers=headers | {"content-type": "application/json"})
    except httpx.HTTPError as e:
        return RequestResult(False, kind=kind, error=repr(e)[:200])
    return _bad_result(kind, r.status_code, r.content)


async def _send_oversized(base_url: str, headers: dict, max_request_bytes: int) -> RequestResult:
    """A body declared one byte over the server's limit, of which only the start is sent (over a raw connection:
    an HTTP client would send it all first): the server must refuse it from its Content-Length alone."""
    url = httpx.URL(base_url)
    https = url.scheme == "https"
    head = [f"POST {url.raw_path.decode().rstrip('/')}/v1/completions HTTP/1.1", f"Host: {url.netloc.decode()}",
            "Content-Type: application/json", f"Content-Length: {max_request_bytes + 1}", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items())]
    try:
        reader, writer = await asyncio.open_connection(url.host, url.port or (443 if https else 80),
                                                       ssl=ssl.create_default_context() if https else None)
        try:
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + b'{"prompt": "')
            answer = await asyncio.wait_for(reader.read(), 30)  # the server closes after its answer
        finally:
            writer.close()
    except (OSError, asyncio.TimeoutError) as e:
        return RequestResult(False, kind="oversized_body", error=repr(e)[:200])
    status_line, _, rest = answer.partition(b"\r\n")
    parts = status_line.split()
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    return _bad_result("oversized_body", status, rest.partition(b"\r\n\r\n")[2])


async def leave_after_first_token(client: httpx.AsyncClient, url: str, headers: dict, model: str,
                                  prompt: list[int], max_tokens: int) -> RequestResult:
    """A streaming client that goes away once its first chunk has come (the server should abort the request)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return RequestResult(False, kind="disconnect", status=r.status_code,
                                     error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                choices = json.loads(line[6:]).get("choices") if line.startswith("data: {") else None
                if choices:
                    if choices[0].get("finish_reason"):  # its first chunk was its last: nothing to leave
                        return RequestResult(False, kind="disconnect", status=200,
                                             error="the request ended before its client could leave")
                    return RequestResult(True, kind="disconnect", status=200)  # leaving closes the connection
    except httpx.HTTPError as e:
        return RequestResult(False, kind="disconnect", error=repr(e)[:200])
    return RequestResult(False, kind="disconnect", status=200, error="the stream ended before its first token")


def _storm_summary(results: list[RequestResult], output_len: int) -> dict:
    valid = [r for r in results if r.kind == "valid"]
    bad = [r for r in results if r.kind in BAD_REQUESTS]
    statuses: dict[str, list] = {}
    for r in bad:
        statuses.setdefault(r.kind, []).append(r.status)
    return {"valid_requests": len(valid),
            "valid_lost": sum(not r.ok or r.output_tokens != output_len for r in valid),  # failed, or cut short
            "disconnected": sum(r.ok for r in results if r.kind == "disconnect"),
            "bad_requests": len(bad), "bad_4xx": sum(r.status is not None and 400 <= r.status < 500 for r in bad),
            "bad_openai_errors": sum(r.ok for r in bad), "bad_statuses": statuses}


async def run_bench_serve(base_url: str, num_prompts: int, input_len: int, output_len: int,
                          max_concurrency: int | None, request_rate: float | None, api_key: str | None,
                          model: str | None, seed: int = 0, max_token_id: int = 50000, storm: bool = False,
                          max_request_bytes: int = SERVER_DEFAULTS.max_request_bytes) -> dict:
    """The calm run, or with storm=True the storm (latencies and completed / failed then count the valid requests
    only). max_request_bytes: the server's limit, which the storm's oversized body exceeds by one byte."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    # ordinary token ids of any large vocabulary (max_token_id bounds them for small ones)
    prompts = [[rng.randrange(min(100, max_token_id - 1), max_token_id) for _ in range(input_len)]
               for _ in range(num_prompts)]
    kinds = storm_kinds(num_prompts, seed) if storm else ["valid"] * num_prompts
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1024)) as client:
        if model is None:
            r = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        url = base_url.rstrip("/") + "/v1/completions"
        limit = asyncio.Semaphore(max_concurrency or num_prompts)

        async def limited(kind, prompt):
            async with limit:
                if kind == "valid":
                    return await _one(client, url, headers, model, prompt, output_len)
                if kind == "disconnect":
                    return await leave_after_first_token(client, url, headers, model, prompt,
                                                         DISCONNECT_MAX_TOKENS_FACTOR * output_len)
                return await send_bad_request(client, base_url.rstrip("/"), headers, kind, model, prompt,
                                              max_request_bytes)

        start = time.perf_counter()
        tasks = []
        for kind, prompt in zip(kinds, prompts):
            tasks.append(asyncio.ensure_future(limited(kind, prompt)))
            if request_rate:  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(request_rate))
        all_results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    results = [r for r in all_results if r.kind == "valid"]
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
    } | (_storm_summary(all_results, output_len) if storm else {})

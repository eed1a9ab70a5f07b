"""`qwenserve bench allreduce`: what one all-reduce costs between worker processes on this host, per message
size, through gloo and through our shared-memory all-reduce (each rank bound to its own CPUs as the mp
executor binds them). Tensor parallelism pays two per
decoder layer per step, on [tokens, hidden] activations: with this table and the step's token count, the
per-step cost of tp follows (the README works it out)."""
from __future__ import annotations

import multiprocessing
import statistics
import time

import torch
import torch.distributed as dist

from qwenserve.config.model_config import resolve_dtype
from qwenserve.distributed.groups import free_port, init_model_parallel
from qwenserve.worker.cpu_tuning import bind_to_cpus, cpu_sets_for_ranks

SIZES = [1 << k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB


def bench_allreduce(world_size: int = 2, dtype: str = "bfloat16", iters: int = 50,
                    cpu_omp_threads_bind: str | None = None) -> dict:
    torch_dtype = resolve_dtype(dtype, None)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, world_size, port, cpus, torch_dtype, iters, results))
             for rank, cpus in enumerate(cpu_sets_for_ranks(world_size, cpu_omp_threads_bind))]
    for p in procs:
        p.start()
    per_rank = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    rows = []
    for i, size in enumerate(SIZES):
        row = {"bytes": size}
        for path in ("gloo", "shm"):
            seconds = max(r[path][i] for r in per_rank)  # a collective takes as long as its slowest rank
            row[f"{path}_us"] = round(seconds * 1e6, 1)
            row[f"{path}_GB_per_s"] = round(size / seconds / 1e9, 3)
        rows.append(row)
    return {"world_size": world_size, "dtype": str(torch_dtype).removeprefix("torch."), "iters": iters,
            "sizes": rows}


def _rank(rank, world, port, cpus, dtype, iters, results) -> None:
    bind_to_cpus(cpus)
    tp, _ = init_model_parallel(rank, world, 1, f"tcp://127.0.0.1:{port}", "gloo", shm_name=f"qwenserve-bench-{port}")
    paths = {"gloo": lambda x: dist.all_reduce(x, group=tp.group), "shm": tp.shm.all_reduce}
    medians = {}
    for path, all_reduce in paths.items():
        medians[path] = []
        for size in SIZES:
            x = torch.ones(size // torch.finfo(dtype).bits * 8, dtype=dtype)
            for _ in range(3):
                all_reduce(x)
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                all_reduce(x)
                times.append(time.perf_counter() - start)
            medians[path].append(statistics.median(times))
    results.put(medians)
    dist.destroy_process_group()


def format_table(result: dict) -> str:
    lines = [f"bench allreduce: {result['world_size']} ranks, {result['dtype']}, median of {result['iters']} calls",
             f"{'bytes':>10} {'gloo us':>10} {'gloo GB/s':>10} {'shm us':>10} {'shm GB/s':>10}"]
    lines += [f"{r['bytes']:>10} {r['gloo_us']:>10} {r['gloo_GB_per_s']:>10} {r['shm_us']:>10} {r['shm_GB_per_s']:>10}"
              for r in result["sizes"]]
    return "\n".join(lines)

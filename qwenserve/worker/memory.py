"""How much memory a worker's KV cache may take. With kv_cache_memory "auto" (the default) a worker measures
what the machine has available once every worker's weights are loaded, keeps a reserve for the processes
(activations, the allocator's slack) and for the rest of the machine, and takes its share of a fraction of the
rest. An explicit size is checked against the same measure, so a configuration that cannot fit fails at start
with the numbers, instead of being killed by the OOM killer mid-request."""
from __future__ import annotations

import os

import torch

from qwenserve.config.errors import ConfigError

GiB = 1 << 30
AUTO_FRACTION = 0.5  # of what is available after the reserve: the machine may be shared, and prefill needs room
RESERVE_BYTES = 1 * GiB  # left to the worker processes themselves (activations, allocator) on top


def available_memory(device: torch.device) -> int:
    """Bytes this process could still allocate on device: free GPU memory, or on the CPU MemAvailable,
    bounded by this process's cgroup limit where it has one."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = _meminfo_available()
    limit = _cgroup_room()
    return min(available, limit) if limit is not None else available


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), if it sets a limit."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None


def kv_cache_budget(kv_cache_memory: int | str, device: torch.device, workers_sharing: int) -> int:
    """Bytes of KV cache for one of `workers_sharing` workers that size their caches from the same memory now.
    Raises ConfigError, with the numbers, if an explicit size cannot fit or nothing is left for "auto"."""
    available = available_memory(device)
    room = max(0, available - RESERVE_BYTES)
    if kv_cache_memory == "auto":
        budget = int(room * AUTO_FRACTION) // workers_sharing
        if budget <= 0:
            raise ConfigError(f"no memory left for the KV cache: {available / GiB:.2f} GiB available after loading "
                              f"the weights, {RESERVE_BYTES / GiB:.2f} GiB kept for the processes")
        return budget
    if kv_cache_memory * workers_sharing > room:
        raise ConfigError(f"kv_cache_memory {kv_cache_memory / GiB:.2f} GiB x {workers_sharing} worker(s) does not "
                          f"fit: {available / GiB:.2f} GiB available after loading the weights, "
                          f"{RESERVE_BYTES / GiB:.2f} GiB of it kept for the processes; lower kv_cache_memory or use "
                          f"auto")
    return kv_cache_memory

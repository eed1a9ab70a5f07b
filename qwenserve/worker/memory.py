"""A worker's memory: how much its KV cache may take, and what its weights hold.

With kv_cache_memory "auto" (the default) a worker measures what the machine has available once every worker's
weights are loaded, keeps a reserve for the processes (activations, the allocator's slack) and for the rest of
the machine, and takes its share of a fraction of the rest, but never more than max_num_seqs sequences of
max_model_len tokens could fill (the caller gives that bound). No prefix-cache allowance is added on top: at the
bound every sequence slot is full to max_model_len and no new prompt could be admitted to hit a cached prefix;
below it, the blocks not in use hold the prefix cache. The cache is reserved, not resident: its pages are backed
as blocks are first written (model/layers/attention.py, `untouched_zeros`), and the scheduler hands out blocks so
that those touched follow the peak traffic (core/kv_cache_manager.py).

An explicit size is checked against the same measure, so a configuration that cannot fit fails at start with the
numbers, instead of being killed by the OOM killer mid-request."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from qwenserve.config.errors import ConfigError
from qwenserve.model.loader.ggml_tensor import GGMLTensor

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


@dataclass(frozen=True)
class KVCacheFit:
    """A worker's answer in the executor's KV block handshake, and its memory figures."""
    num_blocks: int  # KV blocks its budget holds, at most what max_num_seqs full sequences use
    budget: int  # bytes of KV cache it was given: kv_cache_memory, or what "auto" came to
    bytes_per_block: int  # one block over this worker's layers and kv heads
    weights_bytes: int  # its part of the model's weights (model_weights_bytes)


def kv_cache_budget(kv_cache_memory: int | str, device: torch.device, workers_sharing: int,
                    most_usable: int) -> int:
    """Bytes of KV cache for one of `workers_sharing` workers that size their caches from the same memory now;
    "auto" takes at most most_usable bytes (what the cache could ever have in use), an explicit size is taken as
    given. Raises ConfigError, with the numbers, if an explicit size cannot fit or nothing is left for "auto"."""
    available = available_memory(device)
    room = max(0, available - RESERVE_BYTES)
    if kv_cache_memory == "auto":
        budget = min(int(room * AUTO_FRACTION) // workers_sharing, most_usable)
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


def model_weights_bytes(model: nn.Module) -> int:
    """Bytes of the tensors the model's modules hold: parameters, buffers, and what the linear methods keep beside
    them (ggml blocks, packed copies, kernel arguments), each tensor counted once however many modules share it."""
    seen: set = set()
    total = 0

    def count(value, depth: int = 0) -> None:
        nonlocal total
        if isinstance(value, GGMLTensor):
            value = value.raw
        if isinstance(value, torch.Tensor):
            nbytes = value.numel() * value.element_size()
            # an opaque (oneDNN-packed) tensor has no storage to key on: it is only ever held as itself
            key = (value.data_ptr(), nbytes) if value.layout == torch.strided else id(value)
            if key not in seen:
                seen.add(key)
                total += nbytes
        elif isinstance(value, (list, tuple)) and depth < 3:  # segments: [(offset, blocks)], kernel argument tuples
            for item in value:
                count(item, depth + 1)

    for module in model.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            count(value)
    return total

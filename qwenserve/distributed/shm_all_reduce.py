"""All-reduce among the tensor-parallel ranks of one host through shared memory, for the CPU: gloo's TCP
all-reduce takes 0.3-4 ms a call however small the message (`qwenserve bench allreduce`; a socket round trip
is ~20 us), and tensor parallelism makes two calls per layer per step, which at batch 1 cost more than the
matmuls they follow. (vLLM's CPU backend has a shared-memory all-reduce for the same reason.)

Each rank copies its chunk into its own slot, publishes the chunk's sequence number in its flag, waits until
every flag has reached that number, then sums all slots in rank order, so every rank gets the same bits. Two
sets of slots alternate: a rank can be one chunk ahead of the slowest, never two (it would first need the
slowest's flag for the chunk between), so no slot is overwritten while a peer still reads it.

Ordering relies on x86's store order (the data, then the flag); chunks stay small enough that the copy is made
of ordinary stores, not non-temporal ones (which x86 may reorder). Other architectures use gloo.
"""
from __future__ import annotations

import platform
import time
from multiprocessing import shared_memory

import numpy as np
import torch

CHUNK_BYTES = 256 << 10  # per rank and slot set; below glibc's non-temporal memcpy threshold
_FLAG_STRIDE = 64  # one cache line per rank's flag
SPINS_BEFORE_YIELD = 2000


def shm_all_reduce_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmAllReduce:
    def __init__(self, rank: int, size: int, name: str, create: bool):
        """create: this rank makes the segment (the others attach to it by name after a barrier)."""
        self.rank, self.size = rank, size
        header = size * _FLAG_STRIDE
        nbytes = header + 2 * size * CHUNK_BYTES
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=nbytes if create else 0)
        if create:
            self._shm.buf[:header] = bytes(header)
        self._flags = np.ndarray((size, _FLAG_STRIDE // 8), dtype=np.int64, buffer=self._shm.buf)[:, 0]
        self._data = torch.frombuffer(self._shm.buf, dtype=torch.uint8, offset=header, count=2 * size * CHUNK_BYTES)
        self._seq = 0

    def unlink(self) -> None:
        """Remove the name once every rank has attached: the memory lives on while mapped, and nothing is left
        behind however the processes end."""
        self._shm.unlink()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if not x.is_contiguous():
            return x.copy_(self.all_reduce(x.contiguous()))
        flat = x.view(-1)
        step = CHUNK_BYTES // x.element_size()
        for start in range(0, flat.numel(), step):
            self._reduce_chunk(flat[start:start + step])
        return x

    def _reduce_chunk(self, chunk: torch.Tensor) -> None:
        self._seq += 1
        seq, n = self._seq, chunk.numel()
        slots = self._data.view(2, self.size, CHUNK_BYTES)[seq & 1].view(chunk.dtype)[:, :n]  # [ranks, n]
        slots[self.rank].copy_(chunk)
        self._flags[self.rank] = seq
        spins = 0
        while self._flags.min() < seq:
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                time.sleep(0)  # a peer is late (descheduled): give up the CPU rather than burn it
        chunk.copy_(slots[0])
        for r in range(1, self.size):
            chunk.add_(slots[r])

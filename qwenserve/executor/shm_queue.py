"""A message queue in shared memory: one writer, a fixed set of readers, each of which gets every message.

The engine broadcasts each step's SchedulerOutput to its workers through one (the pickled step lands in shared
memory once, rather than once per worker through a socket), and the output worker returns sampled tokens
through another. A ring of fixed-size slots holds the messages; one larger than a slot spans several. Per
reader, two semaphores count the slots it may read and the slots it has finished with, so nobody spins: a
waiting reader sleeps in the kernel until the writer posts, and the writer blocks only when a reader is a
whole ring behind.
"""
from __future__ import annotations

import pickle
import queue
import struct
import time
from multiprocessing import shared_memory

_HEADER = struct.Struct("<I?")  # bytes of payload in this slot, whether the message continues in the next


class ShmQueue:
    def __init__(self, ctx, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20):
        """ctx: the multiprocessing context the reader processes are started with (for the semaphores)."""
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self._stride = _HEADER.size + slot_bytes
        self._shm = shared_memory.SharedMemory(create=True, size=num_slots * self._stride)
        self._owner = True
        self._readable = [ctx.Semaphore(0) for _ in range(num_readers)]
        self._free = [ctx.Semaphore(num_slots) for _ in range(num_readers)]
        self._next = 0  # the next slot this process writes (writer) or reads (reader)
        self.reader_index: int | None = None

    def reader(self, index: int) -> ShmQueue:
        """This queue as reader `index` sees it (pass the result to that reader's process)."""
        view = object.__new__(ShmQueue)
        view.__dict__.update(self.__dict__)
        view.reader_index, view._next = index, 0
        return view

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_shm"], state["_owner"] = self._shm.name, False
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        # the writer's process owns (and unlinks) the segment; readers only map it. A spawned reader shares
        # the writer's resource tracker, which unlinks the segment if every process dies without closing it.
        self._shm = shared_memory.SharedMemory(name=state["_shm"], create=False)

    # ---- writer ---------------------------------------------------------------------------------------

    def put(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        offset = 0
        while True:
            part = view[offset:offset + self.slot_bytes]
            offset += len(part)
            for free in self._free:
                free.acquire()
            base = self._next * self._stride
            _HEADER.pack_into(self._shm.buf, base, len(part), offset < len(data))
            self._shm.buf[base + _HEADER.size:base + _HEADER.size + len(part)] = part
            self._next = (self._next + 1) % self.num_slots
            for readable in self._readable:
                readable.release()
            if offset >= len(data):
                return

    # ---- reader ---------------------------------------------------------------------------------------

    def get(self, timeout: float | None = None):
        """The next message; queue.Empty if none begins within timeout seconds."""
        parts = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # once a message has begun, its other parts are already posted or about to be
            wait = None if deadline is None or parts else max(0.0, deadline - time.monotonic())
            if not self._readable[self.reader_index].acquire(timeout=wait):
                raise queue.Empty
            base = self._next * self._stride
            size, more = _HEADER.unpack_from(self._shm.buf, base)
            parts.append(bytes(self._shm.buf[base + _HEADER.size:base + _HEADER.size + size]))
            self._next = (self._next + 1) % self.num_slots
            self._free[self.reader_index].release()
            if not more:
                return pickle.loads(b"".join(parts))

    def close(self) -> None:
        self._shm.close()
        if self._owner:
            self._shm.unlink()


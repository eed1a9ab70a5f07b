"""Owns the KV cache blocks: who holds which block, reference counts, and the prefix cache.

A block is identified for prefix caching by a chained hash: sha256(parent block's hash, its token ids, extra
keys: the content hash of each image whose placeholder tokens it holds). sha256 makes a hit collision-safe. Blocks nobody references stay in a free queue; a cached one is
reused by a later request with the same prefix until allocation evicts it (least recently freed first).
The manager knows sequences only as holders of a block table; it never sees tensors.

Which block a sequence gets, so that resident memory follows the peak traffic, not the reservation: the worker's
cache pages become resident only when a block is first written, so the blocks ever handed out (`num_touched`,
always ids 0 .. num_touched - 1) are the cache's resident memory. In order:
1. a used block holding no cached prefix (reusing it loses nothing);
2. the lowest block id never used, while fewer cached prefix blocks are free than the most blocks ever live at once
   (`peak_live`): the prefix cache may keep as much as the peak traffic used, so a burst of unrelated requests no
   larger than the peak does not evict a prefix that is about to be asked for again;
3. otherwise the least recently freed cached block, evicting its prefix.
So the touched blocks never exceed twice the peak in use (once with prefix caching off), however long the
engine runs and however large the reservation.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from qwenserve.core.request import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 bytes_per_block: int = 0):
        """bytes_per_block: what one block id takes in every worker's cache (all layers), for the memory figures;
        0 where unknown."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        if bytes_per_block < 0:
            raise ValueError(f"bytes_per_block must be >= 0, got {bytes_per_block}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.bytes_per_block = bytes_per_block
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # used blocks with ref 0, in the order they are reused: uncached ones first, then cached ones least
        # recently freed first; blocks num_touched and up were never handed out and are free too
        self.free: OrderedDict[int, None] = OrderedDict()
        self.num_touched = 0
        self.num_live = 0  # blocks with ref > 0
        self.peak_live = 0  # the most blocks ever live at once
        self.cached: dict[bytes, int] = {}  # full-block hash -> block id
        self.hits = 0  # prefix-cache statistics, in tokens
        self.queries = 0

    # ---- queries --------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + self.num_blocks - self.num_touched

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def reserved_bytes(self) -> int:
        """The whole cache, in every worker: reserved address space, resident only where touched."""
        return self.num_blocks * self.bytes_per_block

    @property
    def touched_bytes(self) -> int:
        """The blocks ever handed out, in every worker: the cache's resident memory (pages stay once written)."""
        return self.num_touched * self.bytes_per_block

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------------------

    def _hash_blocks(self, seq: Sequence, num_full_blocks: int) -> None:
        """Extend seq.block_hashes to cover its first num_full_blocks blocks."""
        bs = self.block_size
        while len(seq.block_hashes) < num_full_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else b""
            data = parent + array("q", seq.token_ids[i * bs:(i + 1) * bs]).tobytes() + seq.cache_salt
            # placeholder tokens are the same for every image of a size: the images' content tells blocks apart
            data += b"".join(image.content_hash for image in seq.images if image.overlaps(i * bs, (i + 1) * bs))
            seq.block_hashes.append(hashlib.sha256(data).digest())

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of seq, always leaving at least one token to compute
        (its logits are needed). Read-only: nothing is reserved until allocate(). A request that asked for
        prompt logprobs computes its whole prompt: cached positions would have none."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._hash_blocks(seq, max_blocks)
        hits = []
        for digest in seq.block_hashes[:max_blocks]:
            block = self.cached.get(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation -----------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make seq's block table cover num_computed_tokens + num_new_tokens tokens, first adopting
        cached_blocks (a new sequence's prefix hits). False, with nothing changed, if blocks run out."""
        if cached_blocks:
            assert not seq.block_table and seq.num_computed_tokens == 0
        computed = len(cached_blocks) * self.block_size if cached_blocks else seq.num_computed_tokens
        total = computed + num_new_tokens
        new_needed = self.blocks_needed(total) - len(seq.block_table) - len(cached_blocks)
        reclaimed = sum(1 for b in cached_blocks if self.ref_cnt[b] == 0)  # adopting these takes them off `free`
        if new_needed > self.num_free_blocks - reclaimed:
            return False
        for block in cached_blocks:
            self._take(block)
            seq.block_table.append(block)
        for _ in range(max(new_needed, 0)):
            block = self._pop_free_block()
            self.ref_cnt[block] = 1
            seq.block_table.append(block)
        if cached_blocks:
            seq.num_computed_tokens = computed
            if seq.num_preemptions == 0:  # report and count hits of the first admission only
                seq.num_cached_tokens = computed
                self.hits += computed
        if self.enable_prefix_caching:
            # tokens past the sequence's own are drafts (speculative decoding), maybe rejected: never cached
            self._cache_full_blocks(seq, min(total, seq.num_tokens))
        return True

    def _pop_free_block(self) -> int:
        """The block to hand out next, in the order the module's docstring gives."""
        front = next(iter(self.free), None)
        keep_cached = front is not None and self.block_hash[front] is not None and len(self.free) < self.peak_live
        if front is None or (keep_cached and self.num_touched < self.num_blocks):
            block = self.num_touched
            self.num_touched += 1
        else:
            del self.free[front]
            block = front
            if self.block_hash[block] is not None:
                del self.cached[self.block_hash[block]]
                self.block_hash[block] = None
        self._went_live()
        return block

    def _went_live(self) -> None:
        self.num_live += 1
        self.peak_live = max(self.peak_live, self.num_live)

    def _take(self, block: int) -> None:
        if self.ref_cnt[block] == 0:
            del self.free[block]
            self._went_live()
        self.ref_cnt[block] += 1

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that are full once this step's tokens are written. Their KV is written in the
        same forward pass, before any attention reads it, so a request scheduled beside this one may share them."""
        full = num_tokens // self.block_size
        self._hash_blocks(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block, digest = seq.block_table[i], seq.block_hashes[i]
            if self.block_hash[block] is None and digest not in self.cached:
                self.cached[digest] = block
                self.block_hash[block] = digest
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def uncache_uncomputed(self, seq: Sequence) -> None:
        """Take out of the prefix cache seq's blocks past its computed tokens: registered when their step was
        scheduled, their KV was never written because the step (or this sequence's part of it) failed."""
        first = seq.num_computed_tokens // self.block_size
        for i in range(first, seq.num_registered_blocks):
            block, digest = seq.block_table[i], seq.block_hashes[i]
            if self.block_hash[block] == digest:  # registered by this sequence (else another block holds it)
                del self.cached[digest]
                self.block_hash[block] = None
        seq.num_registered_blocks = min(seq.num_registered_blocks, first)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let child (a sibling sample of parent, same prompt) share parent's full prompt blocks; it computes
        only the rest of the prompt itself. Needs no free blocks."""
        assert not child.block_table
        shared = (child.num_tokens - 1) // self.block_size
        shared = min(shared, parent.num_computed_tokens // self.block_size)
        for block in parent.block_table[:shared]:
            self._take(block)
            child.block_table.append(block)
        child.num_computed_tokens = shared * self.block_size
        child.block_hashes = parent.block_hashes[:shared]
        child.num_registered_blocks = min(parent.num_registered_blocks, shared)

    def free_sequence(self, seq: Sequence) -> None:
        """Drop seq's references. Blocks holding no cached prefix go to the front of the free queue (reusing them
        loses nothing); cached ones to the back, tail blocks first, so they are evicted before the shared prefix."""
        for block in reversed(seq.block_table):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.num_live -= 1
                self.free[block] = None
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def record_query(self, num_prompt_tokens: int) -> None:
        self.queries += num_prompt_tokens

    # ---- invariants (tests) ---------------------------------------------------------------------------

    def check_invariants(self, live: list[Sequence]) -> None:
        refs = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                refs[block] += 1
        assert refs == self.ref_cnt, "reference counts differ from the live block tables"
        assert set(self.free) == {b for b in range(self.num_touched) if self.ref_cnt[b] == 0}, "free queue mismatch"
        assert self.num_live == sum(c > 0 for c in self.ref_cnt) <= self.peak_live, "live block count mismatch"
        assert self.num_touched <= 2 * self.peak_live, "blocks touched beyond twice the peak in use"
        fresh = range(self.num_touched, self.num_blocks)
        assert all(self.ref_cnt[b] == 0 and self.block_hash[b] is None for b in fresh), "a fresh block is in use"
        holds_prefix = [self.block_hash[b] is not None for b in self.free]
        assert holds_prefix == sorted(holds_prefix), "an uncached free block is queued behind a cached one"
        for digest, block in self.cached.items():
            assert self.block_hash[block] == digest
        assert sum(h is not None for h in self.block_hash) == len(self.cached)

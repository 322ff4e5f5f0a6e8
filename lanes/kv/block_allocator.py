"""Which KV blocks of a pool are in use, by how many sequences, and which hold a cached prefix.

A block is free when no sequence holds it (refcount 0). Free blocks wait in one queue in the order
they are taken: blocks with no cached content first, then cached ones least recently used first, so
a cached prefix is evicted only when no plain block is left (vLLM's free-block queue). A cached
block is found by the hash of its token prefix (lanes/kv/prefix_cache.py) and may be held by several
sequences at once; it is rewritten only after eviction, when its hash is dropped.
"""

from collections import OrderedDict

import numpy as np


class PoolFullError(RuntimeError):
    """Not enough free KV blocks or slots; the caller should queue or preempt."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # taken from the front
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds, cached ones included (they are evicted when taken)."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for one holder each; all or none."""
        if n > len(self._free):
            raise PoolFullError(f"{n} KV blocks wanted, {len(self._free)} of {self.num_blocks} free")
        return [self._take() for _ in range(n)]

    def _take(self) -> int:
        block, _ = self._free.popitem(last=False)
        self._forget(block)  # evicted: its content is about to be overwritten
        self.refcount[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            assert self.refcount[block] > 0, f"KV block {block} freed twice"
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self._free[block] = None  # cached: the most recently used, evicted last
                if block not in self._hash_of:
                    self._free.move_to_end(block, last=False)  # nothing worth keeping: reused first

    # ---- prefix caching -----------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def share(self, block: int) -> None:
        """One more holder of a cached block (a free one leaves the eviction queue)."""
        if self.refcount[block] == 0:
            del self._free[block]
        self.refcount[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """`block` (held, full) now caches the prefix `block_hash`; the first block to do so keeps it."""
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._by_hash[block_hash]

"""Prefix caching: full KV blocks found again by the tokens up to and in them.

A full block's key chains its parent block's key with its own tokens (vLLM's scheme), so equal keys
mean equal token prefixes, not only equal blocks. Keys are SHA-256 digests: a collision would hand a
request another prompt's KV, so the hash must resist constructed inputs as well as chance.

Each pool keeps its own cached blocks (lanes/kv/block_allocator.py); a request's cached prefix is the
longest run of leading full blocks that every pool of the engine holds (target and draft are
prefilled together, so they must restart from the same position). A pool whose KV may lag (the
draft's, where an engine writes it only for requests that draft) does not bound that run: it takes
what it holds of it, and the draft's catch-up writes the rest. The last prompt token is always
recomputed: its logits give the first output token. Requests that ask for prompt logprobs look up
nothing: those need the logits of every prompt position.
"""

import hashlib

import numpy as np

from lanes.engine.sequence import Sequence
from lanes.kv.pool import KVPool


def block_keys(token_ids: list[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Keys of the first `num_blocks` full blocks of `token_ids`."""
    keys, parent = [], b""
    tokens = np.asarray(token_ids[: num_blocks * block_size], dtype=np.int64)
    for i in range(num_blocks):
        parent = hashlib.sha256(parent + tokens[i * block_size : (i + 1) * block_size].tobytes()).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self, pools: list[tuple[KVPool, str]], lagging: tuple[str, ...] = ()):
        self.pools = pools  # (pool, the Sequence attribute naming its slot there)
        self.lagging = lagging  # slot attributes of the pools that may hold less of a prompt than the others
        self.block_size = pools[0][0].block_size
        assert all(pool.block_size == self.block_size for pool, _ in pools), "pools of one engine share a block size"
        # vLLM's prefix_cache_queries / prefix_cache_hits: prompt tokens looked up, and of those found.
        self.num_queries = 0
        self.num_hits = 0

    def attach(self, seq: Sequence) -> int:
        """Give a newly admitted sequence the cached blocks of its leading full blocks, in every pool;
        returns the tokens they hold (prefill starts after them)."""
        tokens = seq.token_ids[: seq.num_prefill_tokens]
        seq.block_keys = block_keys(tokens, self.block_size, len(tokens) // self.block_size)
        self.num_queries += len(tokens)
        if seq.params.prompt_logprobs is not None:
            return 0
        usable = seq.block_keys[: (len(tokens) - 1) // self.block_size]  # the last token is recomputed
        found = min(self._cached_run(pool, usable) for pool, slot in self.pools if slot not in self.lagging)
        for pool, slot in self.pools:
            run = self._cached_run(pool, usable[:found]) if slot in self.lagging else found
            pool.share_blocks(getattr(seq, slot), [pool.blocks.lookup(key) for key in usable[:run]])
        hit = found * self.block_size
        self.num_hits += hit
        return hit

    @staticmethod
    def _cached_run(pool: KVPool, keys: list[bytes]) -> int:
        for i, key in enumerate(keys):
            if pool.blocks.lookup(key) is None:
                return i
        return len(keys)

    def register(self, seq: Sequence) -> None:
        """Cache the sequence's full blocks whose KV is written in each pool (positions below
        num_prefilled, and below the pool's length for the slot: a lagging pool's may be shorter)."""
        for pool, slot in self.pools:
            slot_id = getattr(seq, slot)
            written = min(seq.num_prefilled, int(pool.lengths[slot_id]))
            full = min(written // self.block_size, len(seq.block_keys))
            blocks = pool.slot_blocks(slot_id)
            for block, key in zip(blocks[:full], seq.block_keys[:full]):
                pool.blocks.register(block, key)

"""Adapter that lets an unmodified HF model read and write our KV pool.

HF attention layers call `past_key_values.update(k, v, layer_idx)` and attend over what it returns.
We scatter the new keys/values into each row's slot at its own positions and return the rows'
slots up to `kv_bound`; the 4D mask built by the runner hides everything past each row's length.
Nothing here mutates lengths: that is the scheduler's job (see lanes/rollback.py).
"""

import torch
from transformers.cache_utils import Cache

from lanes.kv_pool import KVPool


class PoolCache(Cache):
    def __init__(self, pool: KVPool, slot_ids: torch.Tensor, write_pos: torch.Tensor, kv_bound: int):
        # Deliberately not calling Cache.__init__: we hold no per-layer state of our own.
        self.pool = pool
        self.layers = []
        self.slot_rows = slot_ids[:, None].expand_as(write_pos)  # [B, Q]
        self.slot_ids = slot_ids  # [B]
        self.write_pos = write_pos  # [B, Q] absolute positions of the new tokens
        self.kv_bound = kv_bound

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [B, kv_heads, Q, head_dim]
        k_pool, v_pool = self.pool.layer(layer_idx)  # [slots, kv_heads, capacity, head_dim]
        k_pool[self.slot_rows, :, self.write_pos] = key_states.transpose(1, 2).to(k_pool.dtype)
        v_pool[self.slot_rows, :, self.write_pos] = value_states.transpose(1, 2).to(v_pool.dtype)
        keys = k_pool[self.slot_ids, :, : self.kv_bound]  # [B, kv_heads, kv_bound, head_dim]
        values = v_pool[self.slot_ids, :, : self.kv_bound]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_bound

    @property
    def is_compileable(self) -> bool:
        return False

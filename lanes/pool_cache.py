"""Adapter that lets an unmodified HF model write our KV pool.

HF attention layers call `past_key_values.update(k, v, layer_idx)` and attend over what it returns.
We scatter the new keys/values into each row's slot at its own positions and return the layer's
whole pool: the `vpd_pool` attention function (lanes/attention.py) reads each row's slot from it.
Nothing here mutates lengths: that is the scheduler's job (see lanes/rollback.py).
"""

import torch
from transformers.cache_utils import Cache

from lanes.kv_pool import KVPool


class PoolCache(Cache):
    def __init__(self, pool: KVPool, slot_ids: torch.Tensor, write_pos: torch.Tensor):
        # Deliberately not calling Cache.__init__: we hold no per-layer state of our own.
        self.pool = pool
        self.layers = []
        self.slot_rows = slot_ids[:, None].expand_as(write_pos)  # [B, Q]
        self.write_pos = write_pos  # [B, Q] absolute positions of the new tokens

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [B, kv_heads, Q, head_dim]
        k_pool, v_pool = self.pool.layer(layer_idx)  # [slots, kv_heads, capacity, head_dim]
        k_pool[self.slot_rows, :, self.write_pos] = key_states.transpose(1, 2).to(k_pool.dtype)
        v_pool[self.slot_rows, :, self.write_pos] = value_states.transpose(1, 2).to(v_pool.dtype)
        return k_pool, v_pool

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # never consulted: the runner passes positions and a prepared mask

    @property
    def is_compileable(self) -> bool:
        return False

"""Adapter that lets an unmodified HF model write our paged KV pool.

HF attention layers call `past_key_values.update(k, v, layer_idx)` and attend over what it returns.
We scatter the new keys/values into each row's blocks at its own positions (through the block
table) and return the layer's whole block pool: the `vpd_pool` attention function
(lanes/model/attention.py) reads each row's blocks from it. Nothing here mutates lengths or the block
table: that is the scheduler's job (see lanes/spec/rollback.py).
"""

import torch
from transformers.cache_utils import Cache

from lanes.kv.pool import KVPool


def block_positions(block_table: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where absolute `positions` [B, Q] of rows `slot_ids` [B] live: (block [B, Q], offset [B, Q])."""
    blocks = block_table[slot_ids[:, None], positions // block_size].long()
    return blocks, positions % block_size


class PoolCache(Cache):
    def __init__(self, pool: KVPool, slot_ids: torch.Tensor, write_pos: torch.Tensor):
        # Deliberately not calling Cache.__init__: we hold no per-layer state of our own.
        self.pool = pool
        self.layers = []
        # [B, Q] each, computed once for all layers
        self.blocks, self.offsets = block_positions(pool.block_table_device, slot_ids, write_pos, pool.block_size)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [B, kv_heads, Q, head_dim]
        k_pool, v_pool = self.pool.layer(layer_idx)  # [blocks + 1, kv_heads, block_size, head_dim]
        k_pool[self.blocks, :, self.offsets] = key_states.transpose(1, 2).to(k_pool.dtype)
        v_pool[self.blocks, :, self.offsets] = value_states.transpose(1, 2).to(v_pool.dtype)
        return k_pool, v_pool

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # never consulted: the runner passes positions and a prepared mask

    @property
    def is_compileable(self) -> bool:
        return False

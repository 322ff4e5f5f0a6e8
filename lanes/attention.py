"""Attention over the KV pool, plugged into unmodified HF models through their AttentionInterface.

PoolCache hands the attention function the whole layer pool instead of a gathered batch copy;
`PoolAttentionMeta` (passed through the model's forward kwargs) says which slot each row reads and
how long it is. On CUDA, few-token steps (decode, verify) run the Triton kernel that reads slots in
place; everything else (prefill, CPU) gathers the rows' slots and runs SDPA, causal: with a mask
when rows start at different positions, without one when every row starts at 0 (whole prompts).
"""

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

POOL_ATTENTION = "vpd_pool"
# Not cuDNN: it builds an execution plan for every new (batch, length) shape, and prompt lengths
# rarely repeat. On an H200 a 7B + 1.1B prefill of one prompt took 105 ms at a length seen for the
# first time and 16 ms at a repeat (benchmarks/prefill_shapes.py); flash attention has no plans.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class PoolAttentionMeta:
    slot_ids: torch.Tensor  # [B] int64
    kv_lens: torch.Tensor  # [B] int32: tokens in each slot before this forward's writes
    kv_bound: int | None  # keys the gather path reads (None: only the in-place kernel may run)
    # Additive [B, 1, Q, kv_bound] for the gather path; None there when every row starts at
    # position 0 (whole prompts): plain causal attention, which needs no mask.
    mask: torch.Tensor | None
    splits: int  # key splits of the in-place kernel (fixed per batch size, for CUDA graphs)
    use_kernel: bool


def pool_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, pool_meta: PoolAttentionMeta | None = None, **kwargs):
    """query [B, H, Q, D]; key/value: the layer's pool [slots, kv_heads, capacity, D]. -> [B, Q, H, D].

    Without pool_meta (the model called as a plain HF model, e.g. `generate` with a DynamicCache)
    this is HF's own SDPA attention, so the model keeps working outside the runner.
    """
    if pool_meta is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attend(query, key, value, pool_meta, scale), None


def attend(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: PoolAttentionMeta,
           scale: float) -> torch.Tensor:
    """query [B, H, Q, D] over each row's slot of the layer pools [slots, kv_heads, capacity, D] -> [B, Q, H, D]."""
    if meta.use_kernel:
        from lanes.triton_attention import pool_attention

        return pool_attention(query, k_pool, v_pool, meta.slot_ids, meta.kv_lens, scale, meta.splits)
    return _gathered_attention(query, k_pool, v_pool, meta, scale)


def _gathered_attention(query, k_pool, v_pool, meta: PoolAttentionMeta, scale: float) -> torch.Tensor:
    keys = k_pool[meta.slot_ids, :, : meta.kv_bound]  # [B, kv_heads, kv_bound, D]
    values = v_pool[meta.slot_ids, :, : meta.kv_bound]
    with sdpa_kernel(SDPA_BACKENDS):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=meta.mask, is_causal=meta.mask is None, scale=scale,
            enable_gqa=query.shape[1] != keys.shape[1])
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(POOL_ATTENTION, pool_attention_forward)

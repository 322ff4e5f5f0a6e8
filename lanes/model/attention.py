"""Attention over the KV pool, plugged into unmodified HF models through their AttentionInterface.

PoolCache hands the attention function the whole layer's block pool instead of a gathered batch
copy; `PoolAttentionMeta` (passed through the model's forward kwargs) says which slot each row reads,
how long it is, and where the slot's blocks are (the pool's device block table). On CUDA, few-token
steps (decode, verify) run the Triton kernel that reads blocks in place; everything else (prefill,
CPU) gathers the rows' blocks into a batch copy and runs SDPA, causal: with a mask when rows start at
different positions, without one when every row starts at 0 (whole prompts).

Two per-layer features of the HF attention call are honoured on both paths: `sliding_window` (a
query at position t sees keys t - window + 1 .. t: Mistral, Qwen2, Gemma, Phi-3) and `softcap`
(scores become softcap * tanh(scores / softcap) before the softmax: Gemma-2). Any other feature an
HF layer passes that changes what it attends to is refused (`UNSUPPORTED_KWARGS`), never ignored.
"""

from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

POOL_ATTENTION = "vpd_pool"
# Not cuDNN: it builds an execution plan for every new (batch, length) shape, and prompt lengths
# rarely repeat. On an H200 a 7B + 1.1B prefill of one prompt took 105 ms at a length seen for the
# first time and 16 ms at a repeat (docs/diagnoses.md); flash attention has no plans.
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
    block_table: torch.Tensor  # [slots + 1, blocks_per_slot] int32: the pool's, on the device
    # Gather-path masks of sliding-window layers, built by the first such layer and shared by the rest.
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


# Attention-call arguments that change the result and that the pool paths do not implement:
# attention sinks (gpt-oss) and additive position biases.
UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias")


def pool_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, pool_meta: PoolAttentionMeta | None = None,
                           sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """query [B, H, Q, D]; key/value: the layer's blocks [blocks, kv_heads, block_size, D]. -> [B, Q, H, D].

    Without pool_meta (the model called as a plain HF model, e.g. `generate` with a DynamicCache)
    this is HF's own SDPA attention, so the model keeps working outside the runner (HF's SDPA
    ignores `softcap`: references for Gemma-2 use HF's eager attention).
    """
    if pool_meta is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    unsupported = [name for name in UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
    if unsupported:
        raise NotImplementedError(f"pool attention does not implement {unsupported} ({type(module).__name__})")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attend(query, key, value, pool_meta, scale, sliding_window, softcap), None


def attend(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: PoolAttentionMeta,
           scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """query [B, H, Q, D] over each row's blocks of the layer pools [blocks, kv_heads, block_size, D]
    -> [B, Q, H, D]. `window`: keys a query sees, itself included (None: all before it); `softcap`:
    tanh cap on the scores."""
    if meta.use_kernel:
        from lanes.model.triton_attention import pool_attention

        return pool_attention(query, k_pool, v_pool, meta.block_table, meta.slot_ids, meta.kv_lens, scale,
                              meta.splits, window, softcap)
    return _gathered_attention(query, k_pool, v_pool, meta, scale, window, softcap)


def gather_rows(pool: torch.Tensor, block_table: torch.Tensor, slot_ids: torch.Tensor, bound: int) -> torch.Tensor:
    """The first `bound` positions of each row's slot, [B, kv_heads, bound, D], from blocks
    [blocks, kv_heads, block_size, D] (a copy, as the unpaged gather was)."""
    size = pool.shape[2]
    blocks = block_table[slot_ids, : -(-bound // size)].long()  # [B, n]
    # Gathered heads-first, so that a row's blocks lie end to end: one copy, and a view after it.
    gathered = pool.transpose(0, 1)[:, blocks]  # [kv_heads, B, n, block_size, D]
    heads, batch, n, _, dim = gathered.shape
    return gathered.transpose(0, 1).reshape(batch, heads, n * size, dim)[:, :, :bound]


def _gathered_attention(query, k_pool, v_pool, meta: PoolAttentionMeta, scale: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    keys = gather_rows(k_pool, meta.block_table, meta.slot_ids, meta.kv_bound)  # [B, kv_heads, kv_bound, D]
    values = gather_rows(v_pool, meta.block_table, meta.slot_ids, meta.kv_bound)
    mask = meta.mask
    if window is not None:
        if window not in meta.window_masks:
            meta.window_masks[window] = _window_mask(meta, query.shape[2], window, query.dtype)
        mask = meta.window_masks[window]
    if softcap is not None:
        return _softcapped_attention(query, keys, values, mask, scale, softcap, meta)
    with sdpa_kernel(SDPA_BACKENDS):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=query.shape[1] != keys.shape[1])
    return out.transpose(1, 2).contiguous()


def _window_mask(meta: PoolAttentionMeta, q_len: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, Q, kv_bound]: query i of row b, at position t = kv_lens[b] + i, sees keys
    max(0, t - window + 1) .. t (HF's sliding-window mask; window None: plain causal)."""
    device = meta.kv_lens.device
    positions = meta.kv_lens[:, None].long() + torch.arange(q_len, device=device)  # [B, Q]
    keys = torch.arange(meta.kv_bound, device=device)[None, None, :]
    allowed = keys <= positions[:, :, None]
    if window is not None:
        allowed &= keys > positions[:, :, None] - window
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def _softcapped_attention(query, keys, values, mask, scale: float, softcap: float,
                          meta: PoolAttentionMeta) -> torch.Tensor:
    """SDPA has no soft-capping: the scores are computed here, in HF's eager order (scale, cap, mask,
    softmax in at least float32)."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale  # [B, H, Q, kv_bound]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:  # rows from position 0: causal over their own tokens
        mask = _window_mask(meta, query.shape[2], None, query.dtype)
    weights = torch.softmax(scores + mask, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32))
    return torch.matmul(weights.to(values.dtype), values).transpose(1, 2).contiguous()


AttentionInterface.register(POOL_ATTENTION, pool_attention_forward)

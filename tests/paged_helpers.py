"""Paged copies of dense per-slot KV tensors, for testing the paged attention paths against dense references."""

import torch


def paginate(dense: torch.Tensor, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dense [slots, kv_heads, capacity, D] -> (blocks [slots * n + 1, kv_heads, block_size, D] in a
    shuffled order plus a junk block, block table [slots, n] int32), n = ceil(capacity / block_size)."""
    slots, heads, capacity, dim = dense.shape
    n = -(-capacity // block_size)
    padded = torch.nn.functional.pad(dense, (0, 0, 0, n * block_size - capacity))
    ordered = padded.view(slots, heads, n, block_size, dim).permute(0, 2, 1, 3, 4).reshape(slots * n, heads,
                                                                                          block_size, dim)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(slots * n, generator=gen)
    blocks = torch.randn(slots * n + 1, heads, block_size, dim, generator=gen).to(dense.dtype)
    blocks[perm] = ordered
    return blocks, perm.view(slots, n).to(torch.int32)


def dense_attention(query, k_dense, v_dense, slot_ids, kv_lens, scale, window=None, softcap=None):
    """query [B, H, Q, D] over each row's dense slot [slots, kv_heads, capacity, D], causal from
    kv_lens[b], eager arithmetic -> [B, Q, H, D]."""
    q_len = query.shape[2]
    bound = int(kv_lens.max()) + q_len
    keys, values = k_dense[slot_ids, :, :bound], v_dense[slot_ids, :, :bound]
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = kv_lens[:, None].long() + torch.arange(q_len)
    key_pos = torch.arange(bound)[None, None, :]
    allowed = key_pos <= positions[:, :, None]
    if window is not None:
        allowed &= key_pos > positions[:, :, None] - window
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), values).transpose(1, 2)

"""One batched forward of an HF causal LM over rows that each sit at their own length in the pool."""

import torch

from lanes.kv_pool import KVPool
from lanes.pool_cache import PoolCache

KV_BOUND_MULTIPLE = 64  # round the attended length up so shapes repeat (fewer allocator / kernel variants)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool):
        self.model = model
        self.pool = pool
        self.device = pool.kv.device
        # Running the decoder and the LM head separately lets us apply the head to chosen rows only.
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self._neg = torch.finfo(model.dtype).min

    @torch.inference_mode()
    def forward(self, slots: list[int], input_ids: torch.Tensor, kv_lens: list[int], keep: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model on `input_ids` [B, Q] appended after `kv_lens` tokens of each row's slot.

        Writes the Q new keys/values of every row (padding included, past the row's valid length,
        where nothing reads them). Returns float32 logits [B, Q, V], or [B, V] at the per-row
        query index `keep` [B] when given.
        """
        batch, q_len = input_ids.shape
        assert len(slots) == batch == len(kv_lens), (len(slots), batch, len(kv_lens))
        capacity = self.pool.shape.capacity_tokens
        assert max(kv_lens) + q_len <= capacity, f"row would write past the slot capacity {capacity}"
        kv_bound = min(capacity, -(-(max(kv_lens) + q_len) // KV_BOUND_MULTIPLE) * KV_BOUND_MULTIPLE)

        slot_ids = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        starts = torch.tensor(kv_lens, dtype=torch.long).to(self.device, non_blocking=True)
        positions = starts[:, None] + torch.arange(q_len, device=self.device)  # [B, Q]
        mask = self._causal_mask(positions, kv_bound)
        cache = PoolCache(self.pool, slot_ids, positions, kv_bound)
        hidden = self.decoder(
            input_ids=input_ids.to(self.device),
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state  # [B, Q, H]
        if keep is not None:
            # Only the rows' last tokens need logits: skip the LM head on the rest (prefill, catch-up).
            hidden = hidden[torch.arange(batch, device=self.device), keep.to(self.device)]  # [B, H]
        return self.lm_head(hidden).float()

    def _causal_mask(self, positions: torch.Tensor, kv_bound: int) -> torch.Tensor:
        # Additive mask [B, 1, Q, kv_bound]: query at absolute position t sees keys 0..t of its own slot.
        keys = torch.arange(kv_bound, device=self.device)
        allowed = keys[None, None, :] <= positions[:, :, None]
        zero = torch.zeros((), dtype=self.model.dtype, device=self.device)
        neg = torch.full((), self._neg, dtype=self.model.dtype, device=self.device)
        return torch.where(allowed, zero, neg)[:, None]

"""A preallocated KV cache per model: fixed slots, a length per slot, a free list.

The pool is one tensor so that it can be shared with another process in one handle (CUDA IPC) or
copied per slot. Slot lengths live on the host: the scheduler needs them every step to build
positions and masks, and keeping them there avoids a device-to-host sync per step. They are one
numpy array, so a batch's lengths are read (`lengths[slots]`) and set in one operation, not per row.
"""

from dataclasses import dataclass

import numpy as np
import torch


class PoolFullError(RuntimeError):
    """No free KV slot; the caller should queue the request."""


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_slots: int
    capacity_tokens: int  # per slot: max model length plus room for one draft or prefill chunk

    @classmethod
    def for_model(cls, config, num_slots: int, capacity_tokens: int) -> "PoolShape":
        text = config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, num_slots, capacity_tokens)


class KVPool:
    def __init__(self, shape: PoolShape, dtype: torch.dtype, device: str | torch.device, kv: torch.Tensor | None = None):
        self.shape = shape
        # [2 (k, v), layers, slots + 1, kv_heads, capacity, head_dim]. The extra slot is never
        # handed out: padding rows of a fixed-size (CUDA-graph) batch write their junk there.
        self.pad_slot = shape.num_slots
        full = (2, shape.num_layers, shape.num_slots + 1, shape.num_kv_heads, shape.capacity_tokens, shape.head_dim)
        self.kv = kv if kv is not None else torch.zeros(full, dtype=dtype, device=device)
        assert tuple(self.kv.shape) == full, f"pool tensor {tuple(self.kv.shape)} != {full}"
        self.lengths = np.zeros(shape.num_slots + 1, dtype=np.int64)
        self._free = list(range(shape.num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.shape.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise PoolFullError(f"all {self.shape.num_slots} KV slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} freed twice"
        self.lengths[slot] = 0
        self._free.append(slot)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[0, layer_idx], self.kv[1, layer_idx]

    def read_slot(self, slot: int) -> torch.Tensor:
        """The valid KV of one slot, [2, layers, kv_heads, length, head_dim] (for copies between pools)."""
        return self.kv[:, :, slot, :, : self.lengths[slot]]

    def write_slot(self, slot: int, kv: torch.Tensor) -> None:
        length = kv.shape[3]
        self.kv[:, :, slot, :, :length].copy_(kv, non_blocking=True)
        self.lengths[slot] = length

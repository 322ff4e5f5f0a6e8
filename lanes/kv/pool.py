"""A paged KV cache per model: fixed-size blocks handed out as sequences grow, a block table per slot.

A *slot* is the handle of one sequence in the pool (a row of the block table, a length); it holds
no memory of its own, so `max_num_seqs` bounds how many sequences run at once, not how much memory
is reserved. Memory is `num_blocks` blocks of `block_size` tokens; position p of a slot lives in
block `block_table[slot, p // block_size]` at offset `p % block_size`.

The block table has a host copy (numpy: the scheduler changes it without touching the device) and a
device copy that every kernel reads (CUDA graphs capture its address, so it is updated in place,
never reallocated). Rows changed since the last forward travel in one host-to-device copy, before
the next forward (`sync_block_table`), never one copy per row.

Table entries past a slot's held blocks point at the pad block: writes there (rows padded to the
widest in a batch, drafts past a row's own draft length, the pad slot of a fixed-size graph batch)
land in junk memory that no sequence reads. Writes within a held block past the slot's length are
as harmless: nothing reads past a length, and the next real write overwrites them.

The pool is one tensor so that it can be shared with another process in one handle (CUDA IPC):
such a peer writes a request's KV into blocks the owner allocated (`write_blocks`).
"""

import threading
from dataclasses import dataclass, replace

import numpy as np
import torch

from lanes.device.batching import to_device
from lanes.kv.block_allocator import BlockAllocator, PoolFullError

__all__ = ["KVPool", "PoolShape", "PoolFullError"]


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_slots: int  # sequences held at once (block-table rows)
    capacity_tokens: int  # per slot: max model length plus room for one draft or prefill chunk
    block_size: int = 16
    num_blocks: int = 0  # 0: enough for every slot at full capacity (nothing oversubscribed)

    def __post_init__(self):
        if self.num_blocks == 0:
            object.__setattr__(self, "num_blocks", self.num_slots * self.blocks_per_slot)

    @property
    def blocks_per_slot(self) -> int:
        return -(-self.capacity_tokens // self.block_size)

    @property
    def block_elements(self) -> int:
        """Elements of one block over K and V and all layers (times the dtype's size: its bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim

    @classmethod
    def for_model(cls, config, num_slots: int, capacity_tokens: int, block_size: int = 16,
                  num_blocks: int = 0) -> "PoolShape":
        text = config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, num_slots, capacity_tokens, block_size, num_blocks)


class KVPool:
    # Whether a peer process that opens this pool's tensor (CUDA IPC, deployments/placement/kv_transfer.py) may
    # write a request's whole KV into it: not where the pool holds one rank's KV heads (lanes/parallel/kv_handover.py).
    in_place_writable = True

    def __init__(self, shape: PoolShape, dtype: torch.dtype, device: str | torch.device, kv: torch.Tensor | None = None):
        self.shape = shape
        self.block_size = shape.block_size
        # The extra slot and the extra block are never handed out: padding writes land there.
        self.pad_slot = shape.num_slots
        self.pad_block = shape.num_blocks
        # [2 (k, v), layers, blocks + 1, kv_heads, block_size, head_dim]
        full = (2, shape.num_layers, shape.num_blocks + 1, shape.num_kv_heads, shape.block_size, shape.head_dim)
        self.kv = kv if kv is not None else torch.zeros(full, dtype=dtype, device=device)
        assert tuple(self.kv.shape) == full, f"pool tensor {tuple(self.kv.shape)} != {full}"
        self.lengths = np.zeros(shape.num_slots + 1, dtype=np.int64)
        self.block_table = np.full((shape.num_slots + 1, shape.blocks_per_slot), self.pad_block, dtype=np.int32)
        self.num_held = np.zeros(shape.num_slots + 1, dtype=np.int64)  # table entries backed by blocks, per slot
        # [slots + 1, blocks_per_slot] int32: what the kernels read
        self.block_table_device = torch.from_numpy(self.block_table.copy()).to(self.kv.device)
        self.blocks = BlockAllocator(shape.num_blocks)
        self._dirty: set[int] = set()  # slots whose table row changed since the last sync
        self._table_updated: torch.cuda.Event | None = None  # the last table copy, on CUDA
        self._free = list(range(shape.num_slots - 1, -1, -1))
        # A verify replica hands out slots and blocks on its event loop while its worker thread frees
        # them and runs forwards: block bookkeeping is serialised (host work only, never a device wait).
        self._lock = threading.Lock()

    def resize(self, num_blocks: int) -> None:
        """Reallocate the pool, empty, with `num_blocks` blocks: the memory profile (lanes/model/memory_profile.py)
        runs its forwards over a one-sequence pool, then the lane takes what the profile left. Only
        before anything keeps the pool's address (a CUDA graph, a peer's IPC view) or holds a block."""
        assert self.num_used == 0, "resize holds no sequence"
        dtype, device = self.kv.dtype, self.kv.device
        del self.kv  # freed before the larger one is allocated
        if device.type == "cuda":
            torch.cuda.empty_cache()
        KVPool.__init__(self, replace(self.shape, num_blocks=num_blocks), dtype, device)

    # ---- slots ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.shape.num_slots - len(self._free)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    def allocate(self) -> int:
        """A slot with no blocks yet (they come with `reserve` or `write_slot`)."""
        if not self._free:
            raise PoolFullError(f"all {self.shape.num_slots} KV slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} freed twice"
        self._release_from(slot, 0)
        self.lengths[slot] = 0
        self._free.append(slot)

    # ---- blocks -----------------------------------------------------------------------------

    def blocks_short(self, slots: list[int], num_tokens) -> np.ndarray:
        """Per slot, the new blocks needed to back the first `num_tokens[i]` positions of `slots[i]`."""
        wanted = -(-np.asarray(num_tokens, dtype=np.int64) // self.block_size)
        return np.maximum(wanted - self.num_held[slots], 0)

    def blocks_needed(self, slots: list[int], num_tokens) -> int:
        """New blocks needed to back the first `num_tokens[i]` positions of `slots[i]`."""
        return int(self.blocks_short(slots, num_tokens).sum())

    def reserve(self, slots: list[int], num_tokens) -> None:
        """Back the first `num_tokens[i]` positions of `slots[i]` with blocks, all or none (raises
        PoolFullError). Host-side only: the next forward brings the device's table up to date."""
        wanted = -(-np.asarray(num_tokens, dtype=np.int64) // self.block_size)
        assert (wanted <= self.shape.blocks_per_slot).all(), "a slot would pass its capacity"
        with self._lock:
            short = wanted - self.num_held[slots]
            if (short > 0).any():
                new = self.blocks.allocate(int(short[short > 0].sum()))
                for slot, n in zip(np.asarray(slots)[short > 0].tolist(), short[short > 0].tolist()):
                    self.append_blocks(slot, new[:n])
                    new = new[n:]

    def share_blocks(self, slot: int, blocks: list[int]) -> None:
        """Start an empty slot with cached blocks (lanes/kv/prefix_cache.py): it holds their tokens."""
        assert self.num_held[slot] == 0
        with self._lock:
            for block in blocks:
                self.blocks.share(block)
            self.append_blocks(slot, blocks)
        self.lengths[slot] = len(blocks) * self.block_size

    def append_blocks(self, slot: int, blocks: list[int]) -> None:
        """Blocks this slot now holds (allocated, or shared from the prefix cache), after its others."""
        held = int(self.num_held[slot])
        self.block_table[slot, held : held + len(blocks)] = blocks
        self.num_held[slot] = held + len(blocks)
        self._dirty.add(slot)

    def _release_from(self, slot: int, first: int) -> None:
        with self._lock:
            held = int(self.num_held[slot])
            if held > first:
                self.blocks.release(self.block_table[slot, first:held].tolist())
                self.block_table[slot, first:held] = self.pad_block
                self.num_held[slot] = first
                self._dirty.add(slot)

    def slot_blocks(self, slot: int) -> list[int]:
        return self.block_table[slot, : self.num_held[slot]].tolist()

    def sync_block_table(self) -> torch.Tensor | None:
        """Before a forward: copy the changed rows of the host table to the device in one copy (row
        ids packed in front), and order the current stream after the latest such copy. Returns the
        packed rows [changed, 1 + blocks_per_slot] int32 on the device (None when none changed): the
        workers of a tensor-parallel group copy the same rows into their tables (`copy_table_rows`).

        Lanes of one engine run on different streams (lanes/device/streams.py). A block released by one
        sequence and taken by another must not be written through the first one's stale row by a
        stream that has not seen the update: every forward waits for the last table update, on
        whichever stream it ran (a wait on an event is free on the host)."""
        device = self.block_table_device.device
        if self._dirty:
            with self._lock:
                rows = np.fromiter(self._dirty, dtype=np.int32, count=len(self._dirty))
                self._dirty.clear()
                changed = self.block_table[rows]
            packed = to_device(np.concatenate([rows[:, None], changed], axis=1), torch.int32,
                               device)  # [changed, 1 + blocks_per_slot]
            self.copy_table_rows(packed)
            return packed
        if self._table_updated is not None:
            torch.cuda.current_stream(device).wait_event(self._table_updated)
        return None

    def copy_table_rows(self, packed: torch.Tensor) -> None:
        """Copy rows [n, 1 + blocks_per_slot] (row id, then its blocks) into the device table."""
        device = self.block_table_device.device
        self.block_table_device.index_copy_(0, packed[:, 0].long(), packed[:, 1:].to(torch.int32))
        if device.type == "cuda":
            self._table_updated = torch.cuda.Event()
            self._table_updated.record()

    # ---- tensors ----------------------------------------------------------------------------

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V blocks, [blocks + 1, kv_heads, block_size, head_dim] each."""
        return self.kv[0, layer_idx], self.kv[1, layer_idx]

    def read_slot(self, slot: int) -> torch.Tensor:
        """The valid KV of one slot gathered from its blocks, [2, layers, kv_heads, length, head_dim]
        (a copy of `length` tokens, for hand-over between pools)."""
        length = int(self.lengths[slot])
        return self.read_blocks(self.block_table[slot, : -(-length // self.block_size)].tolist(), length)

    def read_blocks(self, blocks: list[int], length: int) -> torch.Tensor:
        """The first `length` tokens' KV held in `blocks`, in order, [2, layers, kv_heads, length, head_dim]."""
        gathered = self.kv[:, :, self._index(blocks)]  # [2, layers, n, kv_heads, block_size, head_dim]
        two, layers, n, heads, size, dim = gathered.shape
        return gathered.permute(0, 1, 3, 2, 4, 5).reshape(two, layers, heads, n * size, dim)[:, :, :, :length]

    def write_slot(self, slot: int, kv: torch.Tensor) -> None:
        """Allocate blocks for `kv` [2, layers, kv_heads, tokens, head_dim] and write it as this slot's KV."""
        length = kv.shape[3]
        self.reserve([slot], [length])
        self.write_blocks(self.slot_blocks(slot), kv)
        self.lengths[slot] = length

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Write `kv` [2, layers, kv_heads, tokens, head_dim] into `blocks`, in order (a peer process
        writes into blocks the owner allocated; it sees no block table)."""
        length, size = kv.shape[3], self.block_size
        full = length // size
        if full:
            two, layers, heads, _, dim = kv.shape
            paged = kv[:, :, :, : full * size].reshape(two, layers, heads, full, size, dim).permute(0, 1, 3, 2, 4, 5)
            index = self._index(blocks[:full])
            for layer in range(layers):  # a layer at a time: the permuted copy is one layer's, not the prompt's
                self.kv[:, layer, index] = paged[:, layer].to(self.kv.dtype)
        if length > full * size:
            self.kv[:, :, blocks[full], :, : length - full * size] = kv[:, :, :, full * size :]

    def _index(self, blocks) -> torch.Tensor:
        return torch.as_tensor(np.asarray(blocks, dtype=np.int64)).to(self.kv.device)

"""A batch's draft tokens handed to a verify process on the same device, without a trip through the host.

Over a socket, a batch's drafts must first reach the host: the decode engine waits there for its
draft kernels to end, pickles, and only then can the verify replica prepare its forward and copy the
drafts back to the device. On one GPU those run one after the other: a torch.profiler trace of pdv's
decode engine on an H200 (docs/lanes_one_gpu.md) showed it queuing its draft kernels in 4.3 ms of a
step and then waiting 4.5 ms more for them in that copy, while the verify replica sat idle.

So a decode engine keeps, for each verify replica on its device, a small ring of device buffers that
the replica mapped once (CUDA IPC). A batch's drafts are copied into the next slot on the engine's
stream, an interprocess event is recorded after the copy, and only the slot's reference (`DraftRef`)
travels. The verify replica queues its forward behind that event on its own stream (`OpenRing.take`).
The engine sends its batch as soon as the draft kernels are queued, and the verify replica prepares
and queues its forward while they still run.

On the CPU the ring is shared memory and needs no event: the copy is done when `put` returns.
"""

from __future__ import annotations

import math
import mmap
import os
import socket
import uuid
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import torch
from torch.multiprocessing.reductions import reduce_tensor

from lanes.device.ipc import gpu_uuid, local_index, open_cuda_tensor

# A decode engine has at most one batch out per verify replica; the spare slots keep a batch it gave up
# on (its replica silent past the timeout) from having its drafts overwritten before that replica reads them.
RING_SLOTS = 4


def device_id(device: torch.device) -> str:
    """Where a ring can be mapped: the GPU (by UUID), or the host memory of this Ray node. Processes under
    another raylet of the same host (a test cluster of several nodes on one machine) count as another
    host, as they would be on a real cluster: they get their drafts through the host, not shared memory."""
    if device.type == "cuda":
        return f"cuda:{gpu_uuid(device)}"
    return f"cpu:{socket.gethostname()}:{os.environ.get('RAY_RAYLET_PID', '')}"  # set by Ray in its workers


@dataclass(frozen=True)
class DraftRef:
    """A batch's drafts in transit: rows [:num_rows] and columns [:width] of slot `slot` of ring `ring_id`."""

    ring_id: str
    slot: int
    num_rows: int
    width: int


@dataclass(frozen=True)
class RingHandle:
    """What maps a ring in another process (sent once per verify replica)."""

    ring_id: str
    device_id: str
    shape: tuple[int, int, int]  # [slots, rows, width]
    memory: tuple | str  # CUDA: reduce_tensor's (rebuild, args); CPU: the shared memory's name
    events: tuple[bytes, ...]  # CUDA: each slot's interprocess event handle; CPU: none


class DraftRing:
    """The decode engine's end: `put` a batch's drafts [B, L] int64 into the next slot."""

    def __init__(self, device: torch.device, max_rows: int, width: int, slots: int = RING_SLOTS):
        self.ring_id = uuid.uuid4().hex
        self.device = device
        self.shape = (slots, max_rows, width)
        self._shm: SharedMemory | None = None
        self._unlinked = False
        if device.type == "cuda":
            self.tokens = torch.zeros(self.shape, dtype=torch.long, device=device)
            self.events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        else:
            self._shm = SharedMemory(create=True, size=8 * math.prod(self.shape))
            self.tokens = torch.frombuffer(self._shm.buf, dtype=torch.long).view(self.shape)
            self.events = []
        self._next = 0

    def handle(self) -> RingHandle:
        memory = reduce_tensor(self.tokens) if self._shm is None else self._shm.name
        return RingHandle(self.ring_id, device_id(self.device), self.shape, memory,
                          tuple(event.ipc_handle() for event in self.events))

    def fits(self, drafts: torch.Tensor) -> bool:
        return (drafts.device == self.device and drafts.dtype == torch.long and drafts.shape[0] <= self.shape[1]
                and drafts.shape[1] <= self.shape[2])

    def put(self, drafts: torch.Tensor) -> DraftRef:
        """Copy `drafts` [B, L] into the next slot on the current stream, and mark the copy's end there."""
        slot = self._next
        self._next = (slot + 1) % self.shape[0]
        rows, width = drafts.shape
        self.tokens[slot, :rows, :width].copy_(drafts)
        if self.events:
            self.events[slot].record()
        return DraftRef(self.ring_id, slot, rows, width)

    def close(self) -> None:
        """Remove the shared memory's name (CPU): mapped as it is, it stays usable, and goes with the last
        process that maps it. A batch being put by another thread meanwhile still lands."""
        if self._shm is not None and not self._unlinked:
            self._unlinked = True
            self._shm.unlink()


class OpenRing:
    """The verify process's end: a ring mapped once, read batch by batch with `take`."""

    def __init__(self, handle: RingHandle):
        self.ring_id = handle.ring_id
        self._mapping: mmap.mmap | None = None
        if handle.device_id.startswith("cuda:"):
            uuid_ = handle.device_id.removeprefix("cuda:")
            self.tokens = open_cuda_tensor(handle.memory, uuid_)
            device = torch.device("cuda", local_index(uuid_))
            self.events = [torch.cuda.Event.from_ipc_handle(device, h) for h in handle.events]
        else:
            # Mapped straight from /dev/shm, not as a SharedMemory: Python < 3.13 registers every SharedMemory it
            # opens with its resource tracker, which would unlink the engine's ring when this process exits.
            fd = os.open(f"/dev/shm/{handle.memory.lstrip('/')}", os.O_RDWR)
            try:
                self._mapping = mmap.mmap(fd, 8 * math.prod(handle.shape))
            finally:
                os.close(fd)
            self.tokens = torch.frombuffer(self._mapping, dtype=torch.long).view(handle.shape)
            self.events = []

    def take(self, ref: DraftRef) -> torch.Tensor:
        """The batch's drafts [B, L], copied out of the ring on the current stream once the engine's copy
        into it has ended there (the host does not wait)."""
        if self.events:
            torch.cuda.current_stream(self.tokens.device).wait_event(self.events[ref.slot])
        return self.tokens[ref.slot, :ref.num_rows, :ref.width].clone()

    def close(self) -> None:
        """Unmap (CPU; a CUDA mapping goes with its tensor). Called once no batch of this ring is left."""
        if self._mapping is not None:
            self.tokens = None  # the tensor over the mapping must go before the mapping can close
            try:
                self._mapping.close()
            except BufferError:  # a view of it is still held somewhere: the mapping goes with the process
                pass
            self._mapping = None


def can_open(handle: RingHandle, device: torch.device) -> bool:
    """Whether a ring offered by `handle` is on `device` (a verify replica maps only rings on its own)."""
    return handle.device_id == device_id(device)

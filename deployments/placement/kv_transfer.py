"""How a request's KV gets from the prefill lane to the decode and verify lanes.

Chosen from where the replicas are, not by hand:
  - same GPU (fractional `num_gpus` on one device): the owner exports its pool once as a CUDA IPC
    handle; the prefill lane opens it and writes a request's KV in place. Only slot ids travel.
  - another GPU of the same node that the prefill lane can see and reach by peer access (the app's
    `kv_peer_access`, deployments/placement/gpu_binding.py): the same, and the write is a device-to-device
    copy over NVLink or PCIe.
  - otherwise (other nodes, GPUs hidden from each other, CPU): the prefill lane copies the
    request's KV out of its scratch slots and it travels through Ray's object store (a real copy)
    into the owner's pool, as a `HostKV`: raw bytes that Ray ships out-of-band, never through
    torch's own pickling.
"""

import asyncio
import os
import warnings
from dataclasses import dataclass, replace

import numpy as np
import ray
import torch
from torch.multiprocessing.reductions import reduce_tensor

from deployments.routing.slot_owners import actor_alive
from lanes.device.ipc import gpu_uuid, open_cuda_tensor
from lanes.kv.pool import KVPool, PoolShape


@dataclass(frozen=True)
class Placement:
    node_id: str
    gpu_uuid: str | None  # None on CPU
    peer_uuids: tuple[str, ...] = ()  # the other GPUs this process sees and can write to by peer access

    @classmethod
    def here(cls, device: str | torch.device) -> "Placement":
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else os.uname().nodename
        device = torch.device(device)
        if device.type != "cuda":
            return cls(node, None)
        index = device.index if device.index is not None else torch.cuda.current_device()
        peers = tuple(gpu_uuid(other) for other in range(torch.cuda.device_count())
                      if other != index and torch.cuda.can_device_access_peer(index, other))
        return cls(node, gpu_uuid(index), peers)

    @classmethod
    def of_engine(cls, node_id: str | None, core) -> "Placement":
        """Where an engine's models run (the draft's device, or the target's where there is no draft;
        the host for a pdv decode lane that drafts by prompt lookup and holds no model), on `node_id`
        (an engine process is no Ray worker and cannot ask Ray its node)."""
        target_pool = getattr(core.verifier, "pool", None)  # a RemoteVerifier has none here
        device = core.draft.device if core.draft is not None else target_pool.kv.device if target_pool else "cpu"
        here = cls.here(device)
        return here if node_id is None else replace(here, node_id=node_id)

    def can_write_into(self, owner: "Placement") -> bool:
        """Whether a process placed here can write straight into `owner`'s GPU memory (CUDA IPC)."""
        if self.gpu_uuid is None or owner.gpu_uuid is None or self.node_id != owner.node_id:
            return False
        return owner.gpu_uuid == self.gpu_uuid or owner.gpu_uuid in self.peer_uuids


@dataclass(frozen=True)
class PoolHandle:
    """A picklable CUDA IPC handle to a whole KV pool; open it once per peer, not per request."""

    owner: str  # unique per exporting replica, to cache opened views
    shape: PoolShape
    gpu_uuid: str  # the pool's GPU: device indices differ between processes that see several GPUs
    ipc: tuple
    actor: object | None = None  # the exporting replica's actor handle: a view is dropped once it dies

    @classmethod
    def export(cls, owner: str, pool: KVPool, actor=None) -> "PoolHandle":
        return cls(owner, pool.shape, gpu_uuid(pool.kv.device), reduce_tensor(pool.kv), actor)

    def open(self) -> KVPool:
        kv = open_cuda_tensor(self.ipc, self.gpu_uuid)
        return KVPool(self.shape, kv.dtype, kv.device, kv=kv)


class PoolViews:
    """Opened views of peers' pools, keyed by owner.

    A view keeps its owner's pool alive: CUDA frees an exported allocation only once every process
    that opened it has closed it, and torch closes it when the last tensor on it goes. So when an
    owner dies, a view of its pool held here keeps all of its KV memory (tens of GiB) on the GPU,
    beside its replacement's new pool: on one H200 a killed verify replica's pool stayed, the app's
    GPU memory rose 1.47x, and came back only when the prefill lane died too
    (benchmarks/results/lanes_1gpu_h200/faults/). `drop_dead` closes the views of dead owners."""

    def __init__(self):
        self._views: dict[str, KVPool] = {}
        self._actors: dict[str, object] = {}  # owner -> its replica's actor handle, where known

    def get(self, handle: PoolHandle) -> KVPool:
        if handle.owner not in self._views:
            self._views[handle.owner] = handle.open()
            if handle.actor is not None:
                self._actors[handle.owner] = handle.actor
        return self._views[handle.owner]

    def __contains__(self, owner: str) -> bool:
        return owner in self._views

    async def drop_dead(self) -> list[str]:
        """Close the views of every owner that Ray reports dead; returns those owners."""
        owners = list(self._actors)
        alive = await asyncio.gather(*(actor_alive(self._actors[owner]) for owner in owners))
        dead = [owner for owner, ok in zip(owners, alive) if not ok]
        for owner in dead:
            del self._views[owner], self._actors[owner]  # the last reference: torch closes the IPC mapping
        return dead


def write_all(writes: list[tuple[KVPool, list[int], torch.Tensor]]) -> list[str]:
    """Write requests' KV into blocks that their owners allocated in pools opened from them, then wait
    once for each owner's GPU. Returns each write's transport: "in_place" on this GPU, "peer" on another.

    Another GPU's pool gets a contiguous device-to-device copy (the copy engines, over NVLink or
    PCIe) into a temporary on that GPU, then the block writes run there: no kernel of this GPU
    touches the owner's memory. torch orders the copy after the work on `kv`'s current stream.
    """
    transports = []
    for pool, blocks, kv in writes:
        peer = pool.kv.device != kv.device
        pool.write_blocks(blocks, kv.contiguous().to(pool.kv.device) if peer else kv)
        transports.append("peer" if peer else "in_place")
    # The owners read this memory next, from their own processes. torch makes an owner GPU's stream
    # wait for a peer copy, so waiting for that GPU covers both copies.
    for device in {pool.kv.device for pool, _, _ in writes}:
        torch.cuda.synchronize(device)
    return transports


@dataclass(frozen=True)
class HostKV:
    """A request's KV on the host, [2, layers, kv_heads, tokens, head_dim], in the form Ray moves fastest.

    Pickling a torch tensor serialises its storage in-band (torch.save into bytes): 64 MiB took
    ~0.2 s each way (docs/diagnoses.md), which made every cross-GPU hand-over cost
    1.4 ms per prompt token. A numpy array goes through pickle protocol 5 out-of-band: one copy into
    the object store, and the receiver maps it without another.
    """

    data: np.ndarray  # uint8, the tensor's bytes
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def from_tensor(cls, kv: torch.Tensor) -> "HostKV":
        # Always a copy, even from the host: `kv` may be a view of a slot that is reused next.
        host = torch.empty(kv.shape, dtype=kv.dtype).copy_(kv.detach())
        return cls(host.view(torch.uint8).numpy(), host.dtype, tuple(host.shape))

    @property
    def num_tokens(self) -> int:
        return self.shape[3]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def tensor(self, device: str | torch.device) -> torch.Tensor:
        """The KV as a tensor on `device` (a view of the received bytes on CPU: read, never written)."""
        with warnings.catch_warnings():
            # Arrays Ray maps from its object store are read-only; torch warns, we only copy out of it.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.data)
        return raw.view(self.dtype).view(self.shape).to(device)

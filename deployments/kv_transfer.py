"""How a request's KV gets from the prefill lane to the decode and verify lanes.

Chosen from where the replicas are, not by hand:
  - same GPU (fractional `num_gpus` on one device): the owner exports its pool once as a CUDA IPC
    handle; the prefill lane opens it and writes a request's KV in place. Only slot ids travel.
  - different GPUs, nodes, or CPU: the prefill lane copies the request's KV out of its scratch
    slots and it travels through Ray's object store (a real copy) into the owner's pool.
"""

import os
from dataclasses import dataclass

import ray
import torch
from torch.multiprocessing.reductions import reduce_tensor

from lanes.kv_pool import KVPool, PoolShape


@dataclass(frozen=True)
class Placement:
    node_id: str
    gpu_uuid: str | None  # None on CPU

    @classmethod
    def here(cls, device: str | torch.device) -> "Placement":
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else os.uname().nodename
        device = torch.device(device)
        if device.type != "cuda":
            return cls(node, None)
        return cls(node, str(torch.cuda.get_device_properties(device).uuid))

    def shares_gpu_with(self, other: "Placement") -> bool:
        return self.gpu_uuid is not None and self.gpu_uuid == other.gpu_uuid and self.node_id == other.node_id


@dataclass(frozen=True)
class PoolHandle:
    """A picklable CUDA IPC handle to a whole KV pool; open it once per peer, not per request."""

    owner: str  # unique per exporting replica, to cache opened views
    shape: PoolShape
    ipc: tuple

    @classmethod
    def export(cls, owner: str, pool: KVPool) -> "PoolHandle":
        return cls(owner, pool.shape, reduce_tensor(pool.kv))

    def open(self) -> KVPool:
        rebuild, args = self.ipc
        kv = rebuild(*args)
        return KVPool(self.shape, kv.dtype, kv.device, kv=kv)


class PoolViews:
    """Opened views of peers' pools, keyed by owner."""

    def __init__(self):
        self._views: dict[str, KVPool] = {}

    def get(self, handle: PoolHandle) -> KVPool:
        if handle.owner not in self._views:
            self._views[handle.owner] = handle.open()
        return self._views[handle.owner]

"""KV hand-over into and out of a tensor-parallel lane: each rank's KV heads to and from its own pool.

A sharded model's pool holds on rank r the KV heads that rank's attention computes (heads r*h to
(r+1)*h of h per rank, lanes/parallel/tensor_parallel.py), in the same blocks on every rank. What travels
between lanes is a request's whole KV [2, layers, kv_heads, tokens, head_dim], so that a lane of
another tensor-parallel size (or none) can take it. Rank 0's pool (`ShardedKVPool`) reads a slot by
gathering every rank's heads of its blocks, and writes one by scattering each rank its own heads into
the blocks rank 0 allocated: the workers meet each in the same ordered channel as the forwards
(lanes/parallel/step.py), so a hand-over lands between the same two forwards on every rank.

The gather and scatter go through rank 0 (NCCL over NVLink between GPUs of one node, gloo on the CPU):
the lane-to-lane transport (Ray's object store) then moves one tensor per request, as it does for an
unsharded lane. A pool that holds only some heads is never written in place by a peer (CUDA IPC):
`in_place_writable` is False, and the prefill lane sends such an owner its KV through Ray.
"""

import torch

from lanes.kv.pool import KVPool, PoolShape
from lanes.parallel.step import READ_KV, WRITE_KV, KVStep, send_kv_step
from lanes.parallel.tensor_parallel import TPGroup

HEAD_DIM = 2  # of a hand-over tensor [2, layers, kv_heads, tokens, head_dim]


class ShardedKVPool(KVPool):
    """Rank 0's pool of a sharded model: its own KV heads, and whole-KV reads and writes over all ranks.
    Call its reads and writes on the thread that runs the runner's forwards (they are collectives)."""

    in_place_writable = False

    def __init__(self, shape: PoolShape, dtype: torch.dtype, device: str | torch.device, tp: TPGroup,
                 model_index: int):
        super().__init__(shape, dtype, device)
        self.tp = tp
        self.model_index = model_index  # the runner the workers' KV steps name (lanes/parallel/step.py)

    # What can fail on rank 0 alone runs before the step is sent: the workers, once told, wait in the
    # collective for rank 0.
    def read_blocks(self, blocks: list[int], length: int) -> torch.Tensor:
        own = super().read_blocks(blocks, length)
        send_kv_step(self.tp, KVStep(READ_KV, self.model_index, list(blocks), length))
        return self.tp.gather(own, HEAD_DIM)

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        kv = kv.to(device=self.kv.device, dtype=self.kv.dtype)
        send_kv_step(self.tp, KVStep(WRITE_KV, self.model_index, list(blocks), kv.shape[3]))
        super().write_blocks(blocks, self.tp.scatter(kv, HEAD_DIM, like=None))


def serve_kv_step(tp: TPGroup, pool: KVPool, step: KVStep) -> None:
    """A worker's side of rank 0's read or write: its own heads of the slot's blocks."""
    if step.op == READ_KV:
        tp.gather(pool.read_blocks(step.blocks, step.length), HEAD_DIM)
        return
    shape = pool.shape
    own = torch.empty(2, shape.num_layers, shape.num_kv_heads, step.length, shape.head_dim, dtype=pool.kv.dtype,
                      device=pool.kv.device)
    pool.write_blocks(step.blocks, tp.scatter(None, HEAD_DIM, like=own))

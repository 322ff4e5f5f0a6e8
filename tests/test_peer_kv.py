"""A prompt's KV written into another GPU's pool by a peer copy, between two Ray actors set up as
lane replicas with `kv_peer_access`. Needs two GPUs of one node (the GPU machine:
`python3 -m pytest -q tests/test_peer_kv.py`); skipped elsewhere, tests/test_gpu_binding.py covers
Ray's side on fake GPUs."""

import os

import pytest
import ray
import torch

from deployments.placement.gpu_binding import lane_device, peer_access_env
from deployments.placement.kv_transfer import Placement, PoolHandle, PoolViews, write_all
from lanes.kv.pool import KVPool, PoolShape

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs of one node")

SHAPE = PoolShape(num_layers=3, num_kv_heads=2, head_dim=16, num_slots=4, capacity_tokens=64)


@ray.remote(num_cpus=0)
class _Lane:
    def __init__(self):
        self.device = lane_device(1)
        self.placement = Placement.here(self.device)
        self.pool = KVPool(SHAPE, torch.bfloat16, self.device)
        self.views = PoolViews()

    def where(self) -> tuple[Placement, str]:
        return self.placement, os.environ["CUDA_VISIBLE_DEVICES"]

    def export(self) -> PoolHandle:
        return PoolHandle.export(f"owner-{id(self)}", self.pool)

    def blocks_for(self, tokens: int) -> tuple[int, list[int]]:
        """A fresh slot backed by the blocks of `tokens` tokens (the owner allocates them)."""
        slot = self.pool.allocate()
        self.pool.reserve([slot], [tokens])
        return slot, self.pool.slot_blocks(slot)

    def write(self, handle: PoolHandle, blocks: list[int], tokens: int, seed: int) -> tuple[str, torch.Tensor]:
        kv = torch.randn((2, SHAPE.num_layers, SHAPE.num_kv_heads, tokens, SHAPE.head_dim),
                         generator=torch.Generator().manual_seed(seed)).to(self.device, torch.bfloat16)
        return write_all([(self.views.get(handle), blocks, kv)])[0], kv.cpu()

    def read(self, slot: int, tokens: int) -> torch.Tensor:
        torch.cuda.synchronize()
        self.pool.lengths[slot] = tokens
        kv = self.pool.read_slot(slot).cpu()
        self.pool.free(slot)
        return kv


def _lanes(n: int, num_gpus: float):
    env = {"env_vars": peer_access_env(num_gpus, True)}
    return [_Lane.options(num_gpus=num_gpus, runtime_env=env).remote() for _ in range(n)]


def test_kv_written_into_another_gpus_pool_arrives_whole(two_fake_gpus):
    owner, writer = _lanes(2, 1)
    (owner_at, _), (writer_at, visible) = ray.get([owner.where.remote(), writer.where.remote()])
    assert owner_at.gpu_uuid != writer_at.gpu_uuid and len(visible.split(",")) == 2
    assert writer_at.can_write_into(owner_at)
    handle = ray.get(owner.export.remote())
    for tokens in (17, 64, 5):  # the opened view is cached and reused
        slot, blocks = ray.get(owner.blocks_for.remote(tokens))
        transport, sent = ray.get(writer.write.remote(handle, blocks, tokens, seed=tokens))
        assert transport == "peer"
        assert torch.equal(ray.get(owner.read.remote(slot, tokens)), sent)


def test_kv_written_into_a_pool_on_the_same_gpu_stays_in_place(two_fake_gpus):
    owner, writer = _lanes(2, 0.5)  # fractions of one GPU: Ray packs both onto it
    (owner_at, _), (writer_at, _) = ray.get([owner.where.remote(), writer.where.remote()])
    assert owner_at.gpu_uuid == writer_at.gpu_uuid
    slot, blocks = ray.get(owner.blocks_for.remote(33))
    transport, sent = ray.get(writer.write.remote(ray.get(owner.export.remote()), blocks, 33, seed=7))
    assert transport == "in_place"
    assert torch.equal(ray.get(owner.read.remote(slot, 33)), sent)

"""PoolViews.drop_dead (deployments/placement/kv_transfer.py): a view of a pool whose owner's actor died is
closed, and the views of live owners stay.

On a GPU a view is a CUDA IPC mapping that keeps the dead owner's whole pool allocated; here, on the
CPU, the pool is a plain tensor and the test checks that no reference to it is left, with real Ray
actors as the owners.
"""

import asyncio
import gc
import time
import weakref

import pytest
import ray
import torch

from deployments.placement.kv_transfer import PoolHandle, PoolViews
from lanes.kv.pool import KVPool, PoolShape
from tests.serve_helpers import ray_cluster

pytestmark = pytest.mark.serve

SHAPE = PoolShape(num_layers=1, num_kv_heads=1, head_dim=4, num_slots=2, capacity_tokens=16)


class CpuPoolHandle(PoolHandle):
    """A handle whose view is a CPU pool (CUDA IPC needs a GPU); the owner's actor is real."""

    def open(self) -> KVPool:
        return KVPool(self.shape, torch.float32, "cpu")


@ray.remote(num_cpus=0)
class Owner:
    def ready(self) -> bool:
        return True


def _dropped_within(views: PoolViews, timeout_s: float) -> list[str]:
    deadline_s = time.monotonic() + timeout_s
    while not (dropped := asyncio.run(views.drop_dead())) and time.monotonic() < deadline_s:
        time.sleep(0.5)
    return dropped


def test_the_view_of_a_dead_owners_pool_is_closed_and_a_live_owners_kept():
    ray_cluster()
    live, doomed = Owner.remote(), Owner.remote()
    ray.get([live.ready.remote(), doomed.ready.remote()])
    views = PoolViews()
    kept = views.get(CpuPoolHandle("live", SHAPE, "cpu", (), live))
    gone = weakref.ref(views.get(CpuPoolHandle("doomed", SHAPE, "cpu", (), doomed)))
    assert asyncio.run(views.drop_dead()) == []  # both alive
    ray.kill(doomed)  # Ray reports it dead a moment later: the prefill lane asks every VIEWS_WATCH_S
    assert _dropped_within(views, 30.0) == ["doomed"]
    gc.collect()
    assert gone() is None, "a reference to the dead owner's pool is left"
    assert "doomed" not in views and "live" in views
    assert views.get(CpuPoolHandle("live", SHAPE, "cpu", (), live)) is kept  # still the same view
    ray.kill(live)

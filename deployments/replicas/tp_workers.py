"""The worker ranks of a tensor-parallel replica, as Ray actors in the replica's placement group.

Every lane that holds the target shards it alike: the engine (decode-lane) replica in the one-replica
modes and in pd, the prefill lane in pd and pdv, the verify lane in pdv. The replica (rank 0: it runs
the engine or the lane) is placed in bundle 0 of the placement group Serve creates for it
(`LaneConfig.deployment_options`, `placement_group_bundles`); worker rank r goes to bundle r, so all N
ranks sit on one node (STRICT_PACK) with a GPU each. Each worker runs `lanes.parallel.worker.run_worker`: it
loads the models on the host, keeps its shard on its device and repeats rank 0's forwards and KV
hand-overs until rank 0 stops it. The actors are the replica's: Ray ends them when it ends.

A worker that dies leaves rank 0 waiting in a collective that never completes (NCCL waits out its
timeout; gloo may fail the step instead). The replica does not wait for that: it awaits each
worker's `run` call, which ends only when the worker does, and on the first to end fails every
request it holds and every new one at once, and fails Serve's health check, so that Serve replaces
the replica and its workers (`ShardWorkers.first_loss`, `watch_workers`: `StreamingFront.lose` in
the engine replica, `LaneWorker.lose` in the prefill and verify lanes).
"""

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import ray
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import AppConfig
from deployments.placement.gpu_binding import lane_device
from lanes.parallel.worker import Loader, free_port, run_worker

log = logging.getLogger(__name__)


@ray.remote(max_concurrency=2)  # `pid` answers while `run` runs
class ShardWorker:
    """One worker rank; `run` lasts as long as the engine."""

    def run(self, rank: int, size: int, address: str, num_gpus: float, load: Loader) -> None:
        run_worker(rank, size, address, lane_device(num_gpus), load)

    def pid(self) -> int:
        """This rank's process id (operators, fault tests)."""
        return os.getpid()


@dataclass
class ShardWorkers:
    """Ranks 1..N-1 of a replica's tensor-parallel group."""

    address: str  # tcp://host:port at which all ranks meet, for rank 0's `build_engine(..., tp_address=)`
    actors: list  # held by the replica: an actor whose handles are all gone is ended
    runs: list[ray.ObjectRef]  # each rank's `run` call, which ends only when the rank does

    async def first_loss(self) -> str:
        """Wait until a worker rank ends (it does only when it dies, fails, or is stopped) and say
        which and how."""
        watches = [asyncio.ensure_future(_ended(rank, run)) for rank, run in enumerate(self.runs, start=1)]
        done, pending = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
        for watch in pending:
            watch.cancel()
        return done.pop().result()


async def _ended(rank: int, run: ray.ObjectRef) -> str:
    try:
        await run
    except Exception as exc:  # noqa: BLE001 - what ended it is the report
        return f"tensor-parallel worker rank {rank} is gone ({type(exc).__name__})"
    return f"tensor-parallel worker rank {rank} stopped"


def start_shard_workers(cfg: AppConfig, lane_name: str, load: Loader) -> ShardWorkers:
    """In a replica of the lane `lane_name`: start ranks 1..N-1 in its placement group, each building
    its shards with `load` (deployments/factories.py `load_shards`, `load_prefill_shards`, ...)."""
    size, lane = cfg.tensor_parallel_size, getattr(cfg, lane_name)
    group = get_current_placement_group()
    if group is None:
        raise RuntimeError("a tensor-parallel replica needs its placement group (placement_group_bundles)")
    address = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
    workers = ShardWorkers(address, [], [])
    for rank in range(1, size):
        worker = ShardWorker.options(
            num_cpus=lane.num_cpus, num_gpus=lane.num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)).remote()
        workers.runs.append(worker.run.remote(rank, size, address, lane.num_gpus, load))
        workers.actors.append(worker)
    return workers


def bind_workers(factory, start_workers) -> tuple:
    """`(factory, None)` for a replica without tensor parallelism; else start its worker ranks
    (`start_workers()`) and return the factory of rank 0, which meets them, and the workers (held by the
    replica: they live as long as it holds them)."""
    if start_workers is None:
        return factory, None
    workers = start_workers()
    return partial(factory, tp_address=workers.address), workers


def watch_workers(workers: ShardWorkers | None, on_loss: Callable[[str], None]) -> asyncio.Task | None:
    """On the replica's event loop (Serve runs constructors on it): `on_loss(reason)` when the first
    worker rank ends."""
    if workers is None:
        return None

    async def watch() -> None:
        reason = await workers.first_loss()
        log.error("%s: failing the lane's work and its health check", reason)
        on_loss(reason)
    return asyncio.get_event_loop().create_task(watch())


async def worker_pids(workers: ShardWorkers | None) -> list[int]:
    """Process ids of the worker ranks (operators, fault tests); [] without tensor parallelism."""
    return list(await asyncio.gather(*(actor.pid.remote() for actor in (workers.actors if workers else []))))

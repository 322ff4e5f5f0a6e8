"""The worker ranks of a tensor-parallel engine replica, as Ray actors in the replica's placement group.

The replica (rank 0: it runs the engine) is placed in bundle 0 of the placement group Serve creates
for it (`LaneConfig.deployment_options`, `placement_group_bundles`); worker rank r goes to bundle r,
so all N ranks sit on one node (STRICT_PACK) with a GPU each. Each worker runs
`lanes.tp_worker.run_worker`: it loads the models on the host, keeps its shard on its device and
repeats the engine's forwards until the engine stops it. The actors are the replica's: Ray ends them
when it ends, and a worker that dies leaves the engine waiting in a collective, which stalls its steps
and fails the replica's health check (Serve then replaces the replica and its workers).
"""

from functools import partial

import ray
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import AppConfig
from deployments.factories import load_shards
from deployments.gpu_binding import lane_device
from lanes.tp_worker import Loader, free_port, run_worker


@ray.remote
class ShardWorker:
    """One worker rank; `run` lasts as long as the engine."""

    def run(self, rank: int, size: int, address: str, num_gpus: float, load: Loader) -> None:
        run_worker(rank, size, address, lane_device(num_gpus), load)


def start_shard_workers(cfg: AppConfig) -> tuple[str, list]:
    """In the engine replica: start ranks 1..N-1 in its placement group. Returns the address (tcp://)
    at which all ranks meet, for rank 0's `build_engine(..., tp_address=)`, and the actors (the
    replica keeps their handles: an actor whose handles are all gone is ended)."""
    size, lane = cfg.tensor_parallel_size, cfg.decode_lane
    group = get_current_placement_group()
    if group is None:
        raise RuntimeError("a tensor-parallel replica needs its placement group (placement_group_bundles)")
    address = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
    workers = []
    for rank in range(1, size):
        worker = ShardWorker.options(
            num_cpus=lane.num_cpus, num_gpus=lane.num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)).remote()
        worker.run.remote(rank, size, address, lane.num_gpus, partial(load_shards, cfg))
        workers.append(worker)
    return address, workers

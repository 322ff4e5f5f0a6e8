"""What a lane replica that runs its jobs on a LaneWorker answers Serve and operators: its health and its
process ids. The prefill and verify replicas share it."""

import os

from deployments.replicas.lane_worker import LaneWorker
from deployments.replicas.tp_workers import ShardWorkers, worker_pids


class LaneServer:
    """Mixed into a replica class that sets `worker` and `shard_workers`; `lane_name` names it in errors."""

    lane_name: str
    worker: LaneWorker
    shard_workers: ShardWorkers | None

    def check_health(self) -> None:
        """Serve's health check: raising marks this replica unhealthy, and Serve replaces it."""
        if (problem := self.worker.problem()) is not None:
            raise RuntimeError(f"{self.lane_name} lane: {problem}")

    async def pid(self) -> int:
        """This replica's process id (operators, fault tests)."""
        return os.getpid()

    async def shard_pids(self) -> list[int]:
        """The process ids of this replica's tensor-parallel worker ranks 1..N-1 (none at TP = 1)."""
        return await worker_pids(self.shard_workers)

    async def health(self) -> str:
        """This lane's state for the ingress's /health: "ok" or why not."""
        return self.worker.problem() or "ok"

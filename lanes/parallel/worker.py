"""The workers of a tensor-parallel group: ranks 1..N-1, each running rank 0's forwards on its shard.

A worker builds the same runners as the engine (`build_runners` with the same config and models,
keeping its own shard), then repeats every forward rank 0 sends (lanes/parallel/step.py), and takes its
part of every KV hand-over (lanes/parallel/kv_handover.py), until told to stop. It samples nothing and keeps no
scheduler: rank 0's block-table rows arrive with the forward that first needs them. Served, workers
are Ray actors in the replica's placement group (deployments/replicas/tp_workers.py); `worker_processes` runs
them as plain processes (tests, one host, no Ray).
"""

import contextlib
import socket
from collections.abc import Callable, Iterator

import torch

from lanes.engine.core import EngineConfig, build_runners
from lanes.model.runner import ModelRunner
from lanes.parallel.kv_handover import serve_kv_step
from lanes.parallel.step import KVStep, receive_step, send_stop
from lanes.parallel.tensor_parallel import TPGroup, close_group, init_group

# What a worker loads: (engine config, models by position as rank 0 passes them, which are sharded).
# Models that are not sharded run on rank 0 alone; a worker's loader may return None for them.
Loader = Callable[[], tuple[EngineConfig, list[torch.nn.Module | None], tuple[bool, ...]]]


def serve_forwards(tp: TPGroup, runners: list[ModelRunner | None]) -> None:
    """Run every forward (and KV hand-over) rank 0 sends, on this rank's shard of the runner it names,
    until it stops."""
    while (step := receive_step(tp)) is not None:
        runner = runners[step.model_index]
        if isinstance(step, KVStep):
            serve_kv_step(tp, runner.pool, step)
            continue
        if step.table_rows is not None:
            runner.pool.copy_table_rows(step.table_rows)
        runner.forward(step.rows, step.input_ids, step.keep, step.prefill)


def run_worker(rank: int, size: int, init_method: str, device: str, load: Loader, timeout_s: float = 600) -> None:
    """A worker's whole life: join the group, build its shards, serve rank 0's forwards, leave."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)  # ranks of one host share its cores; a thread pool each would oversubscribe them
    tp = init_group(rank, size, init_method, device, timeout_s)
    try:
        config, models, sharded = load()
        models = [m if flag else None for m, flag in zip(models, sharded)]  # rank 0 runs the rest alone
        serve_forwards(tp, build_runners(config, *models, tp=tp, sharded=sharded))
    finally:
        close_group()


def free_port() -> int:
    """A TCP port free on every interface of this host now (where the ranks meet)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def worker_processes(size: int, load: Loader, devices: list[str] | None = None,
                     timeout_s: float = 600) -> Iterator[TPGroup]:
    """Start ranks 1..size-1 as processes of this host and make this process rank 0; yields its
    `TPGroup`. `devices[r]`: rank r's device (default: all on the CPU, gloo). On exit the workers are
    stopped and joined."""
    devices = devices or ["cpu"] * size
    address = f"tcp://127.0.0.1:{free_port()}"
    spawn = torch.multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=run_worker, args=(rank, size, address, devices[rank], load, timeout_s),
                             daemon=True) for rank in range(1, size)]
    for worker in workers:
        worker.start()
    tp = None
    try:
        tp = init_group(0, size, address, devices[0], timeout_s)
        yield tp
    finally:
        if tp is not None:
            send_stop(tp)
        close_group()
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()

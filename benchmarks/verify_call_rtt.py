"""The round trip of pdv's verify call alone: one replica calls another through a Serve handle, the way
the decode lane calls the verify lane (deployments/remote.py), with nothing else running in either.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/verify_call_rtt.py [--calls 300] [--rows 8]

The callee answers at once, so each time is the call's transit and Serve's routing, nothing else.
Set beside the `transit_and_handoffs` part of a served pdv cycle (benchmarks/lane_timelines.py
`verify_cycle`, logged by benchmarks/lanes_1gpu.py), it says how much of that part the call itself
explains. The variants add one piece of the real path each:

- `bytes`: a 10 KB payload, the default router;
- `batch`: a VerifyBatch of `--rows` greedy rows (what travels), the verify lane's LeaseRouter;
- `leased`: the same, naming the callee's lease, as every verify call does;
- `leased_thread`: the same, sent from another thread onto the replica's event loop and awaited
  there with a timeout, as the decode engine's thread does (run_coroutine_threadsafe).

Prints one line per variant, p50 and p90 in ms, twice over to show the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import ray
import torch
from ray import serve
from ray.serve.config import RequestRouterConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from deployments.lease_router import LeaseRouter  # noqa: E402
from deployments.leases import replica_lease  # noqa: E402
from deployments.serve_calls import own_request  # noqa: E402
from lanes.sample.params import SamplingParams  # noqa: E402
from lanes.spec.verify import VerifyBatch, VerifyResult  # noqa: E402

VARIANTS = ("bytes", "batch", "leased", "leased_thread")
TIMEOUT_S = 5.0


def greedy_batch(rows: int, lease: str) -> VerifyBatch:
    """`rows` greedy rows of 3 drafts each, leased to `lease`: what a decode step sends."""
    return VerifyBatch(target_slots=list(range(rows)), num_tokens=[200] * rows, last_tokens=[5] * rows,
                       draft_tokens=torch.randint(0, 32000, (rows, 3)), draft_probs=None, num_draft=[3] * rows,
                       params=[SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)] * rows,
                       seeds=list(range(rows)), target_leases=[lease] * rows)


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, request_router_config=RequestRouterConfig(
    request_router_class=LeaseRouter))
class Callee:
    def __init__(self):
        self.lease = replica_lease()

    def get_lease(self) -> str:
        return self.lease

    async def echo(self, payload: bytes) -> list[int]:
        return [1, 2, 3]

    async def verify(self, batch: VerifyBatch, lease: str | None = None) -> VerifyResult:
        rows = len(batch.target_slots)
        return VerifyResult(tokens=[[1, 2, 3]] * rows, num_accepted=[2] * rows)


@serve.deployment(ray_actor_options={"num_cpus": 0.25})
class Caller:
    def __init__(self, callee):
        self.callee = callee

    async def measure(self, variant: str, calls: int, rows: int) -> dict[str, float]:
        """p50 and p90 of `calls` sequential calls of `variant`, in ms."""
        lease = await self.callee.get_lease.remote()
        batch, loop = greedy_batch(rows, lease), asyncio.get_running_loop()
        send = {"bytes": lambda: own_request(self.callee.echo, b"x" * 10_000),
                "batch": lambda: own_request(self.callee.verify, batch),
                "leased": lambda: own_request(self.callee.verify, batch, lease=lease)}
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            if variant == "leased_thread":
                call = asyncio.wait_for(own_request(self.callee.verify, batch, lease=lease), TIMEOUT_S)
                await loop.run_in_executor(None, lambda: asyncio.run_coroutine_threadsafe(call, loop).result())
            else:
                await send[variant]()
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        return {"p50_ms": round(times[len(times) // 2], 2), "p90_ms": round(times[int(len(times) * 0.9)], 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args(argv)
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        caller = serve.run(Caller.bind(Callee.bind()), name="verify-call-rtt", route_prefix=None)
        for variant in VARIANTS + VARIANTS:
            print(variant, caller.measure.remote(variant, args.calls, args.rows).result(), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

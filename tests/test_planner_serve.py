"""The replica planner on a real Serve instance (CPU, tiny pair, mode unified): a burst that one replica
cannot hold within the TTFT target adds a replica through Serve's autoscaler; requests that keep coming one
at a time afterwards let it go again, and every request, those in flight as the replica drains included,
ends complete.

pdv under the planner (every lane autoscaled with it, a burst over the verify lane's KV occupancy adding a
verify replica and no other, every stream the target's greedy output) is tests/test_cluster_autoscaler.py's,
where the new replica also needs a node that Ray's autoscaler starts.
"""

import asyncio
import time

import httpx
import pytest
from ray import serve

from tests.serve_helpers import MODEL, app_config, base_url, serving

pytestmark = pytest.mark.serve

APP = "planner"
MAX_TOKENS = 64
BURST = 16
SCALE_BOUND_S = 60.0  # the planner waits 1 s, Serve starts a replica: seconds, on a busy 2-core host more
# Serve's delays and windows short, so that a test waits seconds, not the defaults' tens of seconds.
FAST_SLO = {"max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 3, "metrics_interval_s": 0.5,
            "look_back_period_s": 2}


@pytest.fixture
def unified(pair_paths):
    target, draft = pair_paths
    config = app_config("unified", target, draft, decode_lane={"num_cpus": 0.05, "num_replicas": 1})
    # Two requests at a time per replica: most of a burst of 16 waits, and its TTFT passes the target at once;
    # one request at a time has a TTFT of tens of ms.
    config["engine"].update(max_num_seqs=2)
    config["slo"] = {"ttft_p95_ms": 300, "tpot_p95_ms": 1000, **FAST_SLO}
    with serving({APP: config}):
        yield


async def _complete(http: httpx.AsyncClient, index: int) -> tuple[int, int]:
    body = {"model": MODEL, "prompt": f"def f{index}(x):", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    response = await http.post(f"{base_url(APP)}/completions", json=body)
    tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else 0
    return response.status_code, tokens


def _replicas(app: str = APP, deployment: str = "DecodeLane") -> int:
    """Running replicas of a deployment, as Serve counts them (one that is stopping no longer does)."""
    return serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)


async def _until(predicate, timeout_s: float, load=None) -> list:
    """Wait for `predicate()`; meanwhile `load()` requests run one after another. Their results."""
    results, deadline = [], time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, "the planner did not scale in time"
        if load is not None:
            results.append(await load())
        else:
            await asyncio.sleep(0.5)
    return results


async def _burst_then_trickle(request, clients: int, scaled_up, scaled_down):
    """`clients` requests in flight (each followed by the next) until `scaled_up()`, then one at a time until
    `scaled_down()`. `request()`: one request's result. Returns both phases' results and the seconds from the
    burst's end to the scale-down."""
    burst, added = [], asyncio.Event()

    async def client():
        while not added.is_set():
            burst.append(await request())

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await _until(scaled_up, SCALE_BOUND_S)
    added.set()
    await asyncio.gather(*tasks)
    up_s = time.monotonic()
    after = await _until(scaled_down, SCALE_BOUND_S, request)
    return burst, after, time.monotonic() - up_s


def test_a_burst_adds_a_replica_and_a_trickle_gives_it_back_losing_none(unified):
    async def run():
        async with httpx.AsyncClient(timeout=300) as http:
            count = iter(range(100_000))
            return await _burst_then_trickle(lambda: _complete(http, next(count)), BURST,
                                             lambda: _replicas() == 2, lambda: _replicas() == 1)

    burst, after, down_s = asyncio.run(run())
    print(f"planner: {len(burst)} requests, {BURST} at a time, added a replica; {len(after)} one at a time while it "
          f"went back down after {down_s:.1f} s")
    assert all(r == (200, MAX_TOKENS) for r in burst + after), burst + after
    assert after, "scaled down before any request ran on two replicas"

"""The replica planner on a real Serve instance (CPU, tiny pair):

- mode unified: a burst that one replica cannot hold within the TTFT target adds a replica through Serve's
  autoscaler; requests that keep coming one at a time afterwards let it go again, and every request, those
  in flight as the replica drains included, ends complete.
- mode pdv: every lane autoscales with the planner as its policy; a burst that fills the verify lane's KV
  slots past its `occupancy_high` (the verify lane's part of TPOT) adds a verify replica and no other; one
  stream at a time then lets it go again, and every stream of both phases is the target's greedy output.
"""

import asyncio
import itertools
import time

import httpx
import pytest
from ray import serve
from ray.serve.context import _get_global_client

from lanes.model.loader import load_model
from tests.engine_helpers import greedy_references
from tests.serve_helpers import MODEL, Streamed, app_config, base_url, serving, stream_greedy

pytestmark = pytest.mark.serve

APP = "planner"
PDV_APP = "planner_pdv"
MAX_TOKENS = 64
BURST = 16
SCALE_BOUND_S = 60.0  # the planner waits 1 s, Serve starts a replica: seconds, on a busy 2-core host more
# Serve's delays and windows short, so that a test waits seconds, not the defaults' tens of seconds.
FAST_SLO = {"max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 3, "metrics_interval_s": 0.5,
            "look_back_period_s": 2}
PDV_LANES = ("PrefillLane", "DecodeLane", "VerifyLane")
PDV_BURST = 6  # streams in flight: 6 of the verify replica's 16 KV slots, 6 of the decode replica's 8 seqs


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


@pytest.fixture
def pdv(pair_paths):
    target, draft = pair_paths
    config = app_config("pdv", target, draft, decode_lane={"num_cpus": 0.05, "num_replicas": 1})
    # Decode replicas of 8 seqs, at most 2: each verify replica's pool has 16 KV slots. The burst holds 6 of them,
    # over the verify lane's occupancy_high (0.3 of a replica's slots, where the default 0.9 would need every slot
    # held at every report); one stream holds 1. Targets the tiny pair meets with room to spare (TTFT, the
    # prefill lane's, and TPOT, the decode lane's) leave the verify lane's occupancy the only signal over its
    # target. draft_shed_grace_s 0: the L controller's shedding is test_planner.py's; here the replica count.
    config["engine"].update(max_num_seqs=8)
    config["controller"] = {"occupancy_high": 0.3}
    config["slo"] = {"ttft_p95_ms": 10_000, "tpot_p95_ms": 1000, "draft_shed_grace_s": 0, **FAST_SLO}
    with serving({PDV_APP: config}):
        yield


@pytest.fixture(scope="module")
def pdv_refs(pair_paths) -> list[tuple[list[int], list[int]]]:
    return greedy_references(load_model(pair_paths[0]), 12, MAX_TOKENS, seed=45)


async def _complete(http: httpx.AsyncClient, index: int) -> tuple[int, int]:
    body = {"model": MODEL, "prompt": f"def f{index}(x):", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    response = await http.post(f"{base_url(APP)}/completions", json=body)
    tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else 0
    return response.status_code, tokens


def _replicas(app: str = APP, deployment: str = "DecodeLane") -> int:
    """Running replicas of a deployment, as Serve counts them (one that is stopping no longer does)."""
    return serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)


def _all_replicas(app: str, deployment: str) -> int:
    """Every replica of a deployment, starting, running or stopping."""
    return sum(serve.status().applications[app].deployments[deployment].replica_states.values())


def _policies(app: str) -> dict[str, str | None]:
    """Each deployment's autoscaling policy, as Serve's controller holds it (None: a fixed count)."""
    deployments = _get_global_client().get_serve_details()["applications"][app]["deployments"]
    return {name: ((d["deployment_config"].get("autoscaling_config") or {}).get("policy") or {}).get("policy_function")
            for name, d in deployments.items()}


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


def test_pdv_a_burst_adds_a_verify_replica_only_and_a_trickle_gives_it_back_losing_none(pdv, pdv_refs):
    assert set(_policies(PDV_APP).items()) >= {(lane, "controller.planner:LanePlanner") for lane in PDV_LANES}
    others = {"PrefillLane": 1, "DecodeLane": 1}  # the most replicas each other lane had while Serve was polled

    def verify_replicas(count: int):
        def reached() -> bool:
            for lane in others:
                others[lane] = max(others[lane], _all_replicas(PDV_APP, lane))
            return _replicas(PDV_APP, "VerifyLane") == count and _all_replicas(PDV_APP, "VerifyLane") == count
        return reached

    async def run():
        async with httpx.AsyncClient(timeout=300) as http:
            refs = itertools.cycle(pdv_refs)

            async def request() -> tuple[Streamed, list[int]]:
                prompt, ref = next(refs)
                return await stream_greedy(http, PDV_APP, prompt, MAX_TOKENS, asyncio.Event()), ref

            return await _burst_then_trickle(request, PDV_BURST, verify_replicas(2), verify_replicas(1))

    burst, after, down_s = asyncio.run(run())
    wrong = [(s.error, len(s.tokens)) for s, ref in burst + after if s.error is not None or s.tokens != ref]
    print(f"planner, pdv: {len(burst)} streams, {PDV_BURST} at a time, added a verify replica; {len(after)} one at "
          f"a time while it went back down after {down_s:.1f} s; other lanes at most {others}; not the target's "
          f"greedy output: {len(wrong)}")
    assert not wrong, wrong
    assert after, "scaled down before any stream ran on two verify replicas"
    assert others == {"PrefillLane": 1, "DecodeLane": 1}, others  # the replica went to the lane over its target

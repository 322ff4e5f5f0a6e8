"""pdv with three verify replicas (CPU, tiny pair, a real Serve instance; issue 18, item 1).

Every verify call of a request reaches the verify replica that holds its target KV (its lease),
through the VerifyLane's request router (deployments/lease_router.py). A verify replica refuses rows
of another replica's slots (and ignores the release of them), and counts them: so 200 greedy
requests that all complete with the target's greedy output, with no such row counted anywhere and
rows verified by each of the three replicas, show that every call reached its owner. Killing one
verify replica then loses no request: its requests are recomputed on the other two (their output is
still the target's greedy output), the others never notice, and every slot is freed.
"""

import asyncio
import os
import signal
import time

import httpx
import pytest
from ray import serve

from deployments.lease_router import UNKNOWN_LEASE_WAIT_S, LeaseGone
from lanes.model.loader import load_model
from tests.engine_helpers import hf_greedy, random_prompts
from tests.serve_helpers import (MODEL, app_config, base_url, lane_stats, serving, streams_across,
                                 wait_for_replicas, wait_until_idle)

pytestmark = pytest.mark.serve

APP = "affinity"
VERIFY_REPLICAS = 3
REQUESTS = 200
MAX_TOKENS = 8
STREAMS = 12
STREAM_TOKENS = 600
STREAM_INTERVAL_MARGIN_S = 0.5  # a stream's last chunk may come this long after its request ended


@pytest.fixture(scope="module", autouse=True)
def app(pair_paths):
    target, draft = pair_paths
    lane = {"num_cpus": 0.05, "health_check_period_s": 1.0}
    config = app_config("pdv", target, draft, prefill_lane=lane, decode_lane={**lane, "num_replicas": 2},
                        verify_lane={**lane, "num_replicas": VERIFY_REPLICAS})
    config["engine"].update(max_model_len=1024)  # streams long enough to be cut by the kill
    with serving({APP: config}):
        _wait_for_verify_replicas(120)
        yield


@pytest.fixture(scope="module")
def greedy_refs(pair_paths) -> list[tuple[list[int], list[int]]]:
    target = load_model(pair_paths[0])
    prompts = random_prompts(REQUESTS, len(target.tokenizer), 1, 40, seed=18)
    return [(p, hf_greedy(target, p, MAX_TOKENS)) for p in prompts]


@pytest.fixture(scope="module")
def stream_refs(pair_paths) -> list[tuple[list[int], list[int]]]:
    target = load_model(pair_paths[0])
    prompts = random_prompts(STREAMS, len(target.tokenizer), 4, 24, seed=1819)
    return [(p, hf_greedy(target, p, STREAM_TOKENS)) for p in prompts]


def _wait_for_verify_replicas(timeout_s: float) -> list[dict]:
    return wait_for_replicas(APP, "VerifyLane", VERIFY_REPLICAS, timeout_s)


async def _completions(prompts: list[list[int]]) -> list[list[int]]:
    limit = asyncio.Semaphore(32)

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        async with limit:
            r = await http.post(f"{base_url(APP)}/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async with httpx.AsyncClient(timeout=300) as http:
        return await asyncio.gather(*(one(http, p) for p in prompts))


def test_200_requests_over_3_verify_replicas_each_verified_by_its_owner(greedy_refs):
    before = {s["lease"]: s for s in _wait_for_verify_replicas(60)}
    outputs = asyncio.run(_completions([p for p, _ in greedy_refs]))
    assert outputs == [ref for _, ref in greedy_refs]
    after = wait_until_idle(APP, "pdv")
    verify = [s for s in after if "lease" in s]
    assert {s["lease"] for s in verify} == set(before), "a verify replica was replaced during the run"
    rows = {s["lease"]: s["rows_verified"] - before[s["lease"]]["rows_verified"] for s in verify}
    print("rows verified per verify replica:", rows)
    assert all(n > 0 for n in rows.values()), rows  # every replica held requests and verified them
    # Each request makes at least one verify call (MAX_TOKENS - 1 tokens after the prefill's first).
    assert sum(rows.values()) >= REQUESTS
    assert all(s["stale_rows"] == s["stale_releases"] == 0 for s in verify), verify


def test_killed_verify_replica_loses_no_request_and_slots_are_freed(greedy_refs, stream_refs):
    _wait_for_verify_replicas(120)
    wait_until_idle(APP, "pdv")
    handle = serve.get_deployment_handle("VerifyLane", app_name=APP)

    def kill():  # once every stream has its first token: its prompt's KV is in a verify replica
        read_s = time.monotonic()
        held = {s["lease"]: s for s in lane_stats(APP, "VerifyLane")}
        migrated = sum(s["num_migrations"] for s in lane_stats(APP, "DecodeLane"))
        victim = max(held.values(), key=lambda s: s["kv_slots_used"])
        handle.release.remote([], lease=victim["lease"]).result(timeout_s=30)  # this router has seen the victim
        killed_s = time.monotonic()
        os.kill(victim["replica_pid"], signal.SIGKILL)
        return held, victim, migrated, read_s, killed_s

    (held, victim, migrated_before, read_s, killed_s), _, streams = streams_across(
        APP, [p for p, _ in stream_refs], STREAM_TOKENS, kill)
    results = [runs[0] for runs in streams]
    migrated = sum(s["num_migrations"] for s in lane_stats(APP, "DecodeLane")) - migrated_before
    stall_s = max(r.stall_s(killed_s) for r in results)
    print(f"killed a verify replica holding {victim['kv_slots_used']} of the "
          f"{sum(s['kv_slots_used'] for s in held.values())} streams in flight: {migrated} requests recomputed on "
          f"the others; every stream completed; the longest wait for a chunk after the kill: {stall_s:.2f} s")
    assert [r.error for r in results] == [None] * STREAMS
    assert [r.tokens for r in results] == [ref for _, ref in stream_refs]  # the target's greedy output
    # Every request of the victim that was still decoding at the kill moved; the others' verify calls never
    # went to the victim. Streams end within the kill's few hundred ms after the slots were read (on the
    # verify channel a 600-token stream takes a few seconds here): those that ended then, or whose last
    # chunk, held back by stream coalescing, came just after, may have been the victim's and moved nowhere.
    ended = sum(read_s <= r.times_s[-1] <= killed_s + STREAM_INTERVAL_MARGIN_S for r in results)
    assert migrated >= victim["kv_slots_used"] - ended and migrated > 0, (migrated, victim["kv_slots_used"], ended)

    survivors = [s for s in lane_stats(APP, "VerifyLane") if s["lease"] in held]
    assert len(survivors) == VERIFY_REPLICAS - 1 or victim["lease"] not in {s["lease"] for s in survivors}
    assert all(s["stale_rows"] == 0 for s in survivors), survivors
    wait_until_idle(APP, "pdv")  # every slot freed: the moved requests gave theirs back in the survivors
    replaced = _wait_for_verify_replicas(120)  # Serve replaced the dead replica: a new lease
    assert victim["lease"] not in {s["lease"] for s in replaced}
    # A call for the dead replica fails at once, and one for a replica never seen after a bound: neither
    # goes to another replica (which would refuse it anyway) nor waits for one.
    for lease, bound_s in ((victim["lease"], 1.0), ("never-seen", UNKNOWN_LEASE_WAIT_S + 2.0)):
        start_s = time.monotonic()
        with pytest.raises(LeaseGone):
            handle.release.remote([], lease=lease).result(timeout_s=30)
        assert time.monotonic() - start_s < bound_s, (lease, time.monotonic() - start_s)
    assert all(s["stale_releases"] == 0 for s in lane_stats(APP, "VerifyLane"))
    prompts = greedy_refs[:24]
    assert asyncio.run(_completions([p for p, _ in prompts])) == [ref for _, ref in prompts]
    wait_until_idle(APP, "pdv")

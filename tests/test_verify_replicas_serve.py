"""pdv's verify lane on a real Serve instance, with several verify replicas (CPU, tiny pair; issue 18, items 1
and 3). One app serves both parts in turn; each leaves it with three verify replicas and every slot free.

The app is declared as `serve deploy` of a config file declares it (import path + args), with the verify lane's
replica count in the config's `deployments:` section, and rescaled by declaring it again with another count:
Serve's lightweight update, which stops or starts verify replicas and leaves every other replica running.

1. Affinity. Every verify call of a request reaches the verify replica that holds its target KV (its lease),
   through the VerifyLane's request router (deployments/routing/lease_router.py). A verify replica refuses rows of
   another replica's slots (and ignores the release of them), and counts them: so 200 greedy requests that all
   complete with the target's greedy output, with no such row counted anywhere and rows verified by each of the three
   replicas, show that every call reached its owner. Killing one verify replica then loses no request: its
   requests are recomputed on the other two (their output is still the target's greedy output), the others never
   notice, and every slot is freed.
2. Rescaled by the config while streams are in flight. On a scale-down from 3 to 1, the requests whose KV was in a
   stopped replica are recomputed on the survivor (lanes/engine/core.py `_migrate`): every stream completes with
   the target's greedy output, and no slot stays held in any lane. A scale-up from 1 to 3 moves nothing and loses
   nothing, and the new replicas take new requests.

Were two modules (test_verify_affinity, test_verify_drain), each deploying the same pdv app of its own
(docs/testing.md, "Merged tests"). tests/test_verify_autoscale.py keeps an app of its own: a verify lane handed to
the autoscaler after its deploy is no lightweight update (Serve deploys every lane anew).
"""

import asyncio
import os
import signal
import time

import httpx
import pytest
from ray import serve

from deployments.routing.lease_router import UNKNOWN_LEASE_WAIT_S
from deployments.routing.leases import LeaseGone
from lanes.model.loader import load_model
from tests.engine_helpers import greedy_references, hf_greedy, random_prompts
from tests.serve_helpers import (
    MODEL, app_config, base_url, declare, decode_state, delete, lane_stats, serving, streams_across, wait_answering,
    wait_for_replicas, wait_until_idle)

pytestmark = pytest.mark.serve

APP = "verify"
VERIFY_REPLICAS = 3
HEALTH_PERIOD_S = 1.0
STREAMS = 12
REQUESTS = 200  # affinity: greedy requests of GREEDY_TOKENS each
GREEDY_TOKENS = 8
STREAM_TOKENS = 600  # affinity: streams long enough to be cut by the kill
STREAM_INTERVAL_MARGIN_S = 0.5  # a stream's last chunk may come this long after its request ended
RESCALE_TOKENS = 400  # drain: streams long enough to be in flight at the rescale


@pytest.fixture(scope="module")
def config(pair_paths) -> dict:
    target, draft = pair_paths
    lane = {"num_cpus": 0.05, "health_check_period_s": HEALTH_PERIOD_S}
    config = app_config("pdv", target, draft, prefill_lane=lane, decode_lane={**lane, "num_replicas": 2},
                        verify_lane=lane)
    config["engine"].update(max_model_len=1024, max_num_seqs=8)
    return config


@pytest.fixture(scope="module", autouse=True)
def app(config):
    with serving({}):  # the session's cluster, other modules' apps deleted
        try:
            _scale_verify_lane(config, VERIFY_REPLICAS)
            wait_answering([APP])
            _wait_for_verify_replicas(VERIFY_REPLICAS, 180)
            yield
        finally:
            delete([APP])


@pytest.fixture(scope="module")
def target(pair_paths):
    """The tiny target, loaded once for every part's greedy references."""
    return load_model(pair_paths[0])


@pytest.fixture(scope="module")
def greedy_refs(target) -> list[tuple[list[int], list[int]]]:
    prompts = random_prompts(REQUESTS, len(target.tokenizer), 1, 40, seed=18)
    return [(p, hf_greedy(target, p, GREEDY_TOKENS)) for p in prompts]


@pytest.fixture(scope="module")
def stream_refs(target) -> list[tuple[list[int], list[int]]]:
    prompts = random_prompts(STREAMS, len(target.tokenizer), 4, 24, seed=1819)
    return [(p, hf_greedy(target, p, STREAM_TOKENS)) for p in prompts]


@pytest.fixture(scope="module")
def rescale_streams(target) -> list[tuple[list[int], list[int]]]:
    return greedy_references(target, STREAMS, RESCALE_TOKENS, seed=1818)


def _scale_verify_lane(config: dict, num_replicas: int) -> None:
    declare({APP: config}, {APP: [{"name": "VerifyLane", "num_replicas": num_replicas}]})


def _wait_for_verify_replicas(count: int, timeout_s: float) -> list[dict]:
    return wait_for_replicas(APP, "VerifyLane", count, timeout_s)


async def _completions(prompts: list[list[int]]) -> list[list[int]]:
    limit = asyncio.Semaphore(32)

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        async with limit:
            r = await http.post(f"{base_url(APP)}/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async with httpx.AsyncClient(timeout=300) as http:
        return await asyncio.gather(*(one(http, p) for p in prompts))


def test_200_requests_over_3_verify_replicas_each_verified_by_its_owner(greedy_refs):
    before = {s["lease"]: s for s in _wait_for_verify_replicas(VERIFY_REPLICAS, 60)}
    outputs = asyncio.run(_completions([p for p, _ in greedy_refs]))
    assert outputs == [ref for _, ref in greedy_refs]
    after = wait_until_idle(APP, "pdv")
    verify = [s for s in after if "lease" in s]
    assert {s["lease"] for s in verify} == set(before), "a verify replica was replaced during the run"
    rows = {s["lease"]: s["rows_verified"] - before[s["lease"]]["rows_verified"] for s in verify}
    print("rows verified per verify replica:", rows)
    assert all(n > 0 for n in rows.values()), rows  # every replica held requests and verified them
    # Each request makes at least one verify call (GREEDY_TOKENS - 1 tokens after the prefill's first).
    assert sum(rows.values()) >= REQUESTS
    assert all(s["stale_rows"] == s["stale_releases"] == 0 for s in verify), verify


def test_killed_verify_replica_loses_no_request_and_slots_are_freed(greedy_refs, stream_refs):
    _wait_for_verify_replicas(VERIFY_REPLICAS, 120)
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
    replaced = _wait_for_verify_replicas(VERIFY_REPLICAS, 120)  # Serve replaced the dead replica: a new lease
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


def _rescale_under(config: dict, streams: list[tuple[list[int], list[int]]], num_replicas: int):
    """Stream the prompts of `streams`; once each has its first token, record where the KV is, rescale,
    and wait until the lane has its new size. Each prompt is streamed again and again until then, so
    that streams are in flight when Serve stops or starts replicas: a stream that ended before moves
    nothing (CI once saw 0 requests recomputed on a scale-down that way). Returns what the rescale
    recorded and when it ended, when it began, and every stream with its greedy reference."""
    def rescale():
        held = {s["lease"]: s["kv_slots_used"] for s in lane_stats(APP, "VerifyLane")}
        decode = decode_state(APP)
        _scale_verify_lane(config, num_replicas)
        _wait_for_verify_replicas(num_replicas, 180)
        return held, decode, time.monotonic()

    rescaled, began_s, runs = streams_across(APP, [p for p, _ in streams], RESCALE_TOKENS, rescale, repeat=True)
    results = [r for rs in runs for r in rs]
    refs = [ref for (_, ref), rs in zip(streams, runs) for _ in rs]
    return rescaled, began_s, results, refs


def test_scale_down_recomputes_the_stopped_replicas_requests_and_loses_none(config, rescale_streams):
    wait_until_idle(APP, "pdv")
    (held, (decode_pids, migrated_before), _), scaled_s, results, refs = _rescale_under(config, rescale_streams, 1)
    survivors = {s["lease"] for s in _wait_for_verify_replicas(1, 120)}
    decode_pids_after, migrated_after = decode_state(APP)
    stopped = set(held) - survivors
    stall_s = max(r.stall_s(scaled_s) for r in results)
    print(f"verify 3 -> 1 under {len(results)} streams: the 2 stopped replicas held {sum(held[l] for l in stopped)} of "
          f"{sum(held.values())}; {migrated_after - migrated_before} requests recomputed; the longest wait for a "
          f"chunk after the rescale began: {stall_s:.2f} s")
    assert [r.error for r in results] == [None] * len(results)
    assert [r.tokens for r in results] == refs  # the target's greedy output
    assert survivors <= set(held) and len(stopped) == 2  # (a stream may end before the stats are read)
    assert sum(held[l] for l in stopped) > 0, held  # the stopped replicas held requests when asked to stop
    assert migrated_after - migrated_before >= 1
    assert decode_pids_after == decode_pids  # only the verify lane changed
    wait_until_idle(APP, "pdv")  # no slot or block held in the decode lane or the surviving verify replica


def test_scale_up_while_streaming_loses_nothing_and_new_replicas_take_new_requests(config, rescale_streams):
    _wait_for_verify_replicas(1, 60)
    wait_until_idle(APP, "pdv")
    # The new replicas take a while to start: each prompt is streamed again and again until they run.
    (held, (_, migrated_before), grown_s), grow_s, results, refs = _rescale_under(config, rescale_streams, 3)
    in_flight = sum(bool(r.times_s) and r.times_s[0] < grown_s < r.times_s[-1] for r in results)
    print(f"verify 1 -> 3 in {grown_s - grow_s:.1f} s: {len(results)} streams, {in_flight} of them in flight "
          "when the new replicas had started")
    assert in_flight > 0  # the routers learned of the new replicas while these requests ran
    assert [r.error for r in results] == [None] * len(results)
    assert [r.tokens for r in results] == refs
    assert decode_state(APP)[1] == migrated_before  # adding replicas moves no request
    before = {s["lease"]: s["rows_verified"] for s in _wait_for_verify_replicas(3, 180)}
    new = set(before) - set(held)
    assert len(new) == 2

    asyncio.run(_completions([p for p, _ in rescale_streams * 2]))  # each answered 200
    rows = {s["lease"]: s["rows_verified"] - before[s["lease"]] for s in lane_stats(APP, "VerifyLane")}
    print("rows verified per verify replica after the scale-up:", rows)
    assert sum(rows[lease] for lease in new) > 0
    wait_until_idle(APP, "pdv")

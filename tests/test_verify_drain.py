"""Scaling pdv's verify lane while streams are in flight loses no request (CPU, tiny pair, a real
Serve instance; issue 18, items 1 and 3).

The app is deployed as `serve deploy` of a config file does (import path + args) with the verify
lane's replica count in the config's `deployments:` section, and rescaled by declaring it again
with another count: Serve's lightweight update, which stops or starts verify replicas and leaves
every other replica running. On a scale-down from 3 to 1, the requests whose KV was in a stopped
replica are recomputed on the survivor (lanes/engine/core.py `_migrate`): every stream completes
with the target's greedy output, and no slot stays held in any lane. A scale-up from 1 to 3 moves
nothing and loses nothing, and the new replicas take new requests.
"""

import asyncio
import time

import httpx
import pytest

from lanes.model.loader import load_model
from tests.engine_helpers import greedy_references
from tests.serve_helpers import (
    MODEL, app_config, base_url, declare, decode_state, delete, lane_stats, serving, streams_across, wait_answering,
    wait_for_replicas, wait_until_idle)

pytestmark = pytest.mark.serve

APP = "drain"
STREAMS = 12
MAX_TOKENS = 400
HEALTH_PERIOD_S = 1.0


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
            _scale_verify_lane(config, 3)
            wait_answering([APP])
            _wait_for_verify_replicas(3, 180)
            yield
        finally:
            delete([APP])


@pytest.fixture(scope="module")
def streams(pair_paths) -> list[tuple[list[int], list[int]]]:
    return greedy_references(load_model(pair_paths[0]), STREAMS, MAX_TOKENS, seed=1818)


def _scale_verify_lane(config: dict, num_replicas: int) -> None:
    declare({APP: config}, {APP: [{"name": "VerifyLane", "num_replicas": num_replicas}]})


def _wait_for_verify_replicas(count: int, timeout_s: float) -> list[dict]:
    return wait_for_replicas(APP, "VerifyLane", count, timeout_s)


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

    rescaled, began_s, runs = streams_across(APP, [p for p, _ in streams], MAX_TOKENS, rescale, repeat=True)
    results = [r for rs in runs for r in rs]
    refs = [ref for (_, ref), rs in zip(streams, runs) for _ in rs]
    return rescaled, began_s, results, refs


def test_scale_down_recomputes_the_stopped_replicas_requests_and_loses_none(config, streams):
    wait_until_idle(APP, "pdv")
    (held, (decode_pids, migrated_before), _), scaled_s, results, refs = _rescale_under(config, streams, 1)
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


def test_scale_up_while_streaming_loses_nothing_and_new_replicas_take_new_requests(config, streams):
    _wait_for_verify_replicas(1, 60)
    wait_until_idle(APP, "pdv")
    # The new replicas take a while to start: each prompt is streamed again and again until they run.
    (held, (_, migrated_before), grown_s), grow_s, results, refs = _rescale_under(config, streams, 3)
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

    async def burst():
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=300) as http:
            answers = await asyncio.gather(*(http.post(f"{base_url(APP)}/completions", json={**body, "prompt": p})
                                             for p, _ in streams * 2))
        assert all(a.status_code == 200 for a in answers)

    asyncio.run(burst())
    rows = {s["lease"]: s["rows_verified"] - before[s["lease"]] for s in lane_stats(APP, "VerifyLane")}
    print("rows verified per verify replica after the scale-up:", rows)
    assert sum(rows[lease] for lease in new) > 0
    wait_until_idle(APP, "pdv")

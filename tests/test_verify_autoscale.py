"""Serve's autoscaler shrinks pdv's verify lane while streams are in flight and loses no request (CPU,
tiny pair, a real Serve instance; issue 18, item 1).

The verify lane is deployed with an `autoscaling_config` (1 to 3 replicas, 3 at start). Its policy is
scripted (tests/scripted_autoscaling.py: the count a file holds), so the test picks the moment: once
every stream has its first token, the file says 1, and Serve's autoscaler stops two replicas as it
would on a fall in load. The requests whose KV was in them are recomputed on the survivor, as on a
scale-down by the config (tests/test_verify_drain.py): every stream completes with the target's
greedy output, the decode replicas keep running, and no slot stays held.
"""

import pytest

from lanes.model.loader import load_model
from tests.engine_helpers import greedy_references
from tests.serve_helpers import (
    app_config, decode_state, lane_stats, serving, streams_across, wait_for_replicas, wait_until_idle)

pytestmark = pytest.mark.serve

APP = "autoscale"
STREAMS = 12
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def target_file(tmp_path_factory):
    return tmp_path_factory.mktemp("autoscale") / "verify_replicas"


@pytest.fixture(scope="module", autouse=True)
def app(pair_paths, target_file):
    target, draft = pair_paths
    lane = {"num_cpus": 0.05, "health_check_period_s": 1.0}
    policy = {"policy_function": "tests.scripted_autoscaling:ScriptedReplicas",
              "policy_kwargs": {"path": str(target_file)}}
    verify = {**lane, "num_replicas": None,
              # Serve applies its scale-down delay to a custom policy's decision too (600 s by default).
              "autoscaling_config": {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 3, "policy": policy,
                                     "downscale_delay_s": 1, "upscale_delay_s": 1}}
    config = app_config("pdv", target, draft, prefill_lane=lane, decode_lane={**lane, "num_replicas": 2},
                        verify_lane=verify)
    config["engine"].update(max_model_len=1024, max_num_seqs=8)
    with serving({APP: config}):
        wait_for_replicas(APP, "VerifyLane", 3, 180)
        yield


@pytest.fixture(scope="module")
def streams(pair_paths) -> list[tuple[list[int], list[int]]]:
    return greedy_references(load_model(pair_paths[0]), STREAMS, MAX_TOKENS, seed=1919)


def test_the_autoscaler_shrinks_the_verify_lane_under_streams_and_loses_none(streams, target_file):
    wait_until_idle(APP, "pdv")

    def scale_down():
        held = {s["lease"]: s["kv_slots_used"] for s in lane_stats(APP, "VerifyLane")}
        decode = decode_state(APP)
        target_file.write_text("1")
        wait_for_replicas(APP, "VerifyLane", 1, 180)
        return held, decode

    (held, (decode_pids, migrated_before)), _, runs = streams_across(APP, [p for p, _ in streams], MAX_TOKENS,
                                                                     scale_down)
    results = [r[0] for r in runs]
    survivors = {s["lease"] for s in wait_for_replicas(APP, "VerifyLane", 1, 120)}
    decode_pids_after, migrated_after = decode_state(APP)
    stopped = set(held) - survivors
    print(f"autoscaler 3 -> 1 under {STREAMS} streams: the stopped replicas held {sum(held[l] for l in stopped)} "
          f"of {sum(held.values())}; {migrated_after - migrated_before} requests recomputed")
    assert [r.error for r in results] == [None] * STREAMS
    assert [r.tokens for r in results] == [ref for _, ref in streams]  # the target's greedy output
    assert len(stopped) == 2 and sum(held[l] for l in stopped) > 0, held
    assert migrated_after - migrated_before >= 1
    assert decode_pids_after == decode_pids  # the autoscaler changed the verify lane only
    wait_until_idle(APP, "pdv")

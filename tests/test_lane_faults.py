"""A lane replica killed under load in pdv and pd (CPU, tiny pair, a real Serve instance; issue 15,
item 2).

For each lane in turn (prefill, verify, decode in pdv; prefill, decode in pd, whose decode replicas
verify themselves) its replica process gets SIGKILL while streams are in flight. Every stream ends within 10 s: completed, or with a final error event and [DONE]; none
hangs. The surviving lanes free every slot that the dead replica's requests held, Serve replaces
the dead replica by its health check, and the app serves the same greedy output again without a
redeploy: the decode replica finds the new prefill or verify replica by itself, and never reads or
frees a slot of the dead verify replica in the new one (the verify lane's lease).
"""

import json
import threading
import time

import httpx
import pytest

from loadtest.faults import kill_and_recover, lane_processes
from loadtest.workload import WorkloadRequest
from tests.client_errors import assert_clean
from tests.serve_helpers import (
    HTTP_PORT, MODEL, app_config, base_url, greedy_choice, kill_under_streams, lane_stats, record_stream, serving,
    wait_until_idle)

pytestmark = pytest.mark.serve

MODES = ("pdv", "pd")  # each mode's app is named after it
# pdv as a user deploys it: one replica a lane, Serve's default health-check period (10 s), so that
# the only verify replica's death is noticed, and replaced, tens of seconds after the kill.
ONE_VERIFY = "pdv1"
KILLS = [("pdv", "PrefillLane"), ("pdv", "VerifyLane"), ("pdv", "DecodeLane"), ("pd", "PrefillLane"),
         ("pd", "DecodeLane")]
STREAMS = 12
HEALTH_PERIOD_S = 1.0
RECOVERY_LOG: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def app(pair_paths):
    target, draft = pair_paths
    lane = {"num_cpus": 0.05, "health_check_period_s": HEALTH_PERIOD_S}
    configs = {mode: app_config(mode, target, draft, decode_lane={**lane, "num_replicas": 2}, prefill_lane=lane,
                                verify_lane=lane) for mode in MODES}
    configs[ONE_VERIFY] = app_config("pdv", target, draft, decode_lane={"num_cpus": 0.05, "num_replicas": 1})
    for config in configs.values():
        config["engine"].update(max_model_len=1024, max_num_seqs=16)  # streams long enough to be cut
    with serving(configs):
        yield


def _replica_pid(app: str, deployment: str) -> int:
    return lane_processes(app, deployment)[0].pid  # found as a GPU run finds it (loadtest/faults.py)


def _health(app: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{HTTP_PORT}/{app}/health", timeout=10)


def _wait_healthy(app: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _health(app).status_code != 200:
        assert time.monotonic() < deadline, f"the app did not recover: {_health(app).text}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def greedy_before() -> dict[str, str]:
    return {mode: greedy_choice(mode, "def add(a, b):")["text"] for mode in MODES}


@pytest.mark.parametrize(("mode", "deployment"), KILLS)
def test_killed_lane_replica_ends_every_stream_frees_slots_and_recovers(mode, deployment, greedy_before):
    _wait_healthy(mode, 120)
    wait_until_idle(mode, mode)
    pid = _replica_pid(mode, deployment)
    killed_s, results = kill_under_streams(mode, pid, STREAMS, 600)

    completed = failed = 0
    for ended_s, status, events in results:
        if status == 200 and events[-1] == "[DONE]" and '"error"' not in events[-2]:
            completed += 1  # a stream that did not need the dead lane again
            continue
        failed += 1
        assert ended_s - killed_s < 10.0, f"ended {ended_s - killed_s:.1f} s after the kill"
        assert status in (200, 503), status
        if status == 200:
            assert events[-1] == "[DONE]" and '"error"' in events[-2], events[-3:]
            assert_clean(json.loads(events[-2])["error"]["message"])
    # pdv's one verify replica is on every stream's path: each stream is recomputed on its replacement
    # (lanes/engine/core.py `_migrate`) if that is up within PEER_CALL_TIMEOUT_S, else it fails; either
    # way it ends within the bound above.
    if deployment == "DecodeLane":  # one of the two decode replicas: its streams fail, the other's finish
        assert failed >= 1 and completed >= 1, (completed, failed)

    _wait_healthy(mode, 120)
    recovered_s = time.monotonic() - killed_s
    RECOVERY_LOG[f"{mode} {deployment}"] = recovered_s
    print(f"{mode} {deployment}: killed; {completed} streams completed, {failed} failed; "
          f"recovered {recovered_s:.1f} s after the kill")
    assert _replica_pid(mode, deployment) != pid
    wait_until_idle(mode, mode)  # no slot held in the decode or the verify lane (the dead decode
    # replica's verify slots are freed by the verify lane: deployments/routing/slot_owners.py)
    assert greedy_choice(mode, "def add(a, b):")["text"] == greedy_before[mode]
    wait_until_idle(mode, mode)


@pytest.mark.parametrize("mode", MODES)
def test_both_decode_replicas_serve_after_the_kills(mode):
    deadline = time.monotonic() + 120  # /health answers from either replica: Serve may still be starting one
    while len(lane_stats(mode, "DecodeLane")) != 2:
        assert time.monotonic() < deadline, "the killed decode replica was not replaced"
        time.sleep(1)
    print("recovery after the kill, s:", {k: round(v, 1) for k, v in RECOVERY_LOG.items()})


def test_lanes_endpoint_reports_every_replicas_slots_and_queue():
    results: list = [None] * 4
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=record_stream, args=("pdv", i, 600, results, started))
               for i in range(len(results))]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=120)
    busy = httpx.get(f"{base_url('pdv')}/lanes", timeout=30).json()
    for t in threads:
        t.join(timeout=120)
    assert busy["mode"] == "pdv" and set(busy["lanes"]) == {"decode", "prefill", "verify"}
    decode, verify = busy["lanes"]["decode"]["replicas"], busy["lanes"]["verify"]["replicas"]
    assert len(decode) == 2 and len(verify) == 1 and len(busy["lanes"]["prefill"]["replicas"]) == 1
    held = sum(r["running"] + r["queue_depth"] for r in decode)
    assert 0 < held <= 4 and 0 < verify[0]["kv_slots_used"] <= 4, busy
    wait_until_idle("pdv", "pdv")
    idle = httpx.get(f"{base_url('pdv')}/lanes", timeout=30).json()["lanes"]
    assert all(r["running"] == r["queue_depth"] == 0 for r in idle["decode"]["replicas"]), idle
    assert idle["verify"]["replicas"][0]["kv_slots_used"] == 0 and idle["prefill"]["replicas"][0]["queue_depth"] == 0


def test_the_only_verify_replica_dies_and_every_stream_ends_within_10_s_then_the_app_serves_again():
    """Issue 33, item 3: one verify replica, killed under 12 streams at Serve's default health-check
    period, and 4 more streams 1 s after the kill. The replacement takes requests only some 15-35 s
    after the kill; until then no request can be recomputed. Every stream in flight ends within 10 s
    of the kill with a clean error (EngineConfig.recover_within_s: 8 s), or completes by recompute once
    the replacement is up (the better end, which issue 33 allows with a stated bound: 40 s); none times out;
    then the app serves the same greedy output again, with no slot left held. Before recover_within_s
    (7ae022d) the streams waited for the replacement: the last ended 36.8 s after the kill.

    A stream sent during the outage has two ends. It is lost when its hand-over to the verify lane
    gives up (PEER_CALL_TIMEOUT_S after its prompt's forward, behind the recomputes in the prefill
    lane's queue): it ends within recover_within_s of its start or at that moment, whichever is later;
    12 s after its start in two runs on the busy 2-core host, bounded here at 15 s. Or its prompt is
    still queued or handing over when the replacement comes up, and it completes: the better end (16.1 s
    after its start in one run whose replacement was up 17.2 s after the kill), bounded by the
    replacement's 35 s."""
    _wait_healthy(ONE_VERIFY, 120)
    wait_until_idle(ONE_VERIFY, "pdv")
    streams = [WorkloadRequest(f"def f{i}(x):", 5, 600) for i in range(STREAMS)]
    late = [WorkloadRequest(f"def g{i}(y):", 5, 600) for i in range(4)]
    result = kill_and_recover(f"http://127.0.0.1:{HTTP_PORT}/{ONE_VERIFY}", MODEL, ONE_VERIFY, "VerifyLane",
                              ["DecodeLane", "PrefillLane", "VerifyLane"], streams, late, ["def add(a, b):"], 16)
    print("one verify replica killed:", result.summary())
    for record in result.in_flight + result.after:
        assert record.status != "timed_out", record
        if record.status == "failed":  # as when a lane dies under the stream: the client may retry
            # (a 503 before the first token, or an SSE error event after it)
            assert_clean(record.error)
            assert "service_unavailable" in record.error and record.error.endswith("retry"), record.error
    # A stream under way at the kill fails within 10 s of it, or is recomputed and completes once the
    # replacement takes it (its prompt re-prefilled and held by the prefill lane until then): 12 of 12
    # completed 18.0 s after the kill in run 9 (docs/testing.md), bounded by the replacement's 35 s.
    completed_within_s = 40.0  # after the kill: the replacement's 15-35 s, plus 5
    for record, end_s in zip(result.in_flight, result.ends_s(result.in_flight)):
        assert end_s < (10.0 if record.status == "failed" else completed_within_s), result.summary()
    for record, end_s in zip(result.after, result.ends_s(result.after)):
        if record.status == "failed":
            assert record.end_s - record.start_s < 15.0, result.summary()
        else:
            assert end_s < completed_within_s, result.summary()
    assert result.recovered_s is not None, result.notes
    assert result.greedy_equal, "greedy output after recovery differs from before the kill"
    wait_until_idle(ONE_VERIFY, "pdv")

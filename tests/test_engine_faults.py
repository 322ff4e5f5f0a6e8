"""A dead engine on a real Serve instance (CPU, tiny pair): its requests end at once with a final
error event and [DONE], /health says 503, Serve's health check replaces the replica, and the app
then serves the same greedy output again without a redeploy."""

import json
import time

import httpx
import pytest

from tests.client_errors import assert_clean
from tests.serve_helpers import HTTP_PORT, app_config, greedy_choice, kill_under_streams, lane_stats, serving

pytestmark = pytest.mark.serve

APP = "faults"
HEALTH_PERIOD_S = 1.0


@pytest.fixture(scope="module", autouse=True)
def app(pair_paths):
    target, draft = pair_paths
    lane = {"num_cpus": 0.05, "health_check_period_s": HEALTH_PERIOD_S}
    config = app_config("unified", target, draft, decode_lane=lane)
    config["engine"]["max_model_len"] = 2048  # streams long enough to be cut by the kill
    with serving({APP: config}):
        yield


def _health() -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{HTTP_PORT}/{APP}/health", timeout=10)


def test_killed_engine_fails_its_streams_cleanly_and_serve_replaces_it():
    assert _health().json() == {"status": "ok", "lanes": {"engine": "ok"}}
    before = greedy_choice(APP, "def add(a, b):")["text"]
    [stats] = lane_stats(APP, "DecodeLane")
    engine_pid = stats["pid"]

    killed_s, results = kill_under_streams(APP, engine_pid, 6, 2000)
    for ended_s, _, events in results:
        assert ended_s - killed_s < 10.0
        # Each stream ends with an error event, then [DONE].
        assert events[-1] == "[DONE]" and '"error"' in events[-2], events[-3:]
        assert_clean(json.loads(events[-2])["error"]["message"])

    down = _health()
    assert down.status_code == 503 and down.json()["status"] == "unavailable"

    # Serve's health check fails, and it replaces the replica with one that has a new engine.
    deadline = time.monotonic() + 120
    while _health().status_code != 200:
        assert time.monotonic() < deadline, "the app did not recover"
        time.sleep(1)
    recovered_s = time.monotonic() - killed_s
    assert greedy_choice(APP, "def add(a, b):")["text"] == before
    [stats] = lane_stats(APP, "DecodeLane")
    assert stats["pid"] != engine_pid
    print(f"recovered {recovered_s:.1f} s after the kill")

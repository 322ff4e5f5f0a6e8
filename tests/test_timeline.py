"""The busy intervals lanes record for benchmarks (deployments/telemetry/timeline.py)."""

import threading
import time

from deployments.placement.kv_transfer import Placement
from deployments.telemetry import timeline as timeline_module
from deployments.telemetry.timeline import Timeline, event_rows, replica_report


def test_timed_records_the_interval_and_passes_results_and_errors():
    timeline = Timeline()
    before = time.time()
    assert timeline.timed("verify", lambda a, b: a + b, rows=3)(1, 2) == 3
    try:
        timeline.timed("verify", lambda: 1 / 0, rows=1)()
    except ZeroDivisionError:
        pass
    events = timeline.since(before)["verify"]
    assert [e["rows"] for e in events] == [3, 1]  # a failed call still occupied the lane
    assert all(before <= e["start_s"] <= e["end_s"] <= time.time() for e in events)


def test_since_keeps_later_events_and_the_bound_drops_the_oldest():
    timeline = Timeline(max_events=3)
    for i in range(5):
        timeline.record("step", float(i), i + 0.5, rows=i)
    assert [e["rows"] for e in timeline.since(0.0)["step"]] == [2, 3, 4]
    assert [e["rows"] for e in timeline.since(3.2)["step"]] == [3, 4]  # ended after 3.2


def test_events_older_than_the_age_bound_are_dropped():
    # Kinds recorded once per request would otherwise grow for an hour before the count bound holds.
    timeline = Timeline(max_events=1000, max_age_s=10.0)
    for i in range(100):
        timeline.record("request", float(i), i + 0.5, request_id=str(i))
    assert [e["request_id"] for e in timeline.since(0.0)["request"]] == [str(i) for i in range(89, 100)]
    timeline.record("request", 0.0, 1.0, request_id="late")  # an out-of-order end drops nothing
    assert len(timeline.since(0.0)["request"]) == 12


def test_recording_from_threads_while_reading():
    timeline = Timeline(max_age_s=float("inf"))  # its synthetic intervals span 2,000 s

    def work():
        for i in range(2000):
            timeline.record("prefill", i, i + 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        timeline.since(0.0)
    for t in threads:
        t.join()
    assert len(timeline.since(0.0)["prefill"]) == 8000


def test_replica_report_pages_its_events_as_columns(monkeypatch):
    # The process's timeline holds what earlier tests recorded in this process (in-process lanes
    # record hand-overs with other fields): the report is read from an empty one.
    monkeypatch.setattr(timeline_module, "TIMELINE", Timeline())
    for i in range(5):
        timeline_module.TIMELINE.record("handover", 1e9 + i, 1e9 + i + 0.5, tokens=i, target="copied")
    first = replica_report("prefill", Placement("node-1", None), 1e9, offset=0, limit=3)
    assert first["lane"] == "prefill" and first["replica"].startswith("pid-")
    assert first["placement"] == {"node_id": "node-1", "gpu_uuid": None, "peer_uuids": ()}
    assert first["events"]["handover"]["tokens"] == [0, 1, 2] and first["more"]
    second = replica_report("prefill", Placement("node-1", None), 1e9, offset=3, limit=3)
    assert [e["tokens"] for e in event_rows(second["events"]["handover"])] == [3, 4] and not second["more"]
    assert event_rows(second["events"]["handover"])[0] == {"start_s": 1e9 + 3, "end_s": 1e9 + 3.5, "tokens": 3,
                                                           "target": "copied"}

"""The kill benchmark's row and goals (benchmarks/lane_faults.py; issue 33, item 1), on constructed
kill results: no cluster, no model."""

from benchmarks.lane_faults import kill_row, table_row
from loadtest.faults import KillResult, LaneProcess
from loadtest.records import RequestRecord


def record(status: str, end_s: float, index: int = 0) -> RequestRecord:
    return RequestRecord(index=index, kind="normal", prompt_len=4, output_len=8, status=status, start_s=-1.0,
                         end_s=end_s, error=None if status == "completed" else "service_unavailable: lost a lane")


def result(in_flight: list[RequestRecord], **fields) -> KillResult:
    done = KillResult(LaneProcess("pdv", "VerifyLane", 42, "node", "actor"), in_flight, [record("completed", 3.0)],
                      late_after_s=1.0, killed_perf_s=0.0, recovered_s=21.0, replaced_s=21.5, greedy_equal=True)
    for name, value in fields.items():
        setattr(done, name, value)
    return done


def test_a_kill_that_fails_its_streams_in_time_and_comes_back_whole_meets_every_goal():
    row = kill_row("pdv", result([record("failed", 8.1), record("completed", 30.0, 1)],
                                 device_mib_before=40_000.0, device_mib_after=40_500.0,
                                 device_used_mib_before=60_000.0, device_used_mib_after=59_000.0), survivors_replaced=[])
    # A stream that completed (recomputed after the replacement) may end after 10 s; a failed one may not.
    assert row["in_flight_failed_last_end_s"] == 8.1 and row["in_flight_last_end_s"] == 30.0
    assert row["app_mib_ratio"] == 1.0125 and row["device_used_ratio"] == 0.9833
    assert row["goals"] == {"streams_end": True, "served_again": True, "survivors_intact": True,
                            "greedy_equal": True, "memory": True}
    assert table_row(row)["goals met"] == "all"


def test_a_late_failure_a_time_out_a_lost_replacement_or_memory_not_back_each_miss_a_goal():
    late = kill_row("pdv", result([record("failed", 10.5)]))
    assert late["goals"]["streams_end"] is False
    hung = kill_row("pdv", result([record("timed_out", 120.0)]))
    assert hung["goals"]["streams_end"] is False
    unreplaced = kill_row("pdv", result([record("failed", 1.0)], replaced_s=None))
    assert unreplaced["goals"]["served_again"] is False
    crashed_peer = kill_row("pdv", result([record("failed", 1.0)]), survivors_replaced=["DecodeLane"])
    assert crashed_peer["goals"]["survivors_intact"] is False
    assert table_row(crashed_peer)["others replaced"] == "DecodeLane"
    leaked = kill_row("pdv", result([record("failed", 1.0)], device_mib_before=40_000.0, device_mib_after=40_000.0,
                                    device_used_mib_before=60_000.0, device_used_mib_after=66_000.0), [])
    assert leaked["goals"]["memory"] is False  # the app's processes look whole, the GPU holds 10 % more
    assert table_row(leaked)["goals met"] == "NOT memory"


def test_on_the_cpu_memory_is_not_measured_and_says_so():
    row = kill_row("pd", result([record("failed", 0.2)]), survivors_replaced=[])
    assert row["goals"]["memory"] is None and row["app_mib_ratio"] is None and row["goals"]["survivors_intact"]
    line = table_row(row)
    assert line["goals met"] == "all (memory not measured)" and line["app GPU MiB before -> after"] == "n/a"

"""A soak's minutes and goals (loadtest/soak.py; issue 33, item 2), on constructed records and samples."""

import pandas as pd

from loadtest.records import RequestRecord
from loadtest.soak import DRAIN, change, goals, markdown, minutes, read_records, record_row


def row(sent_s: float, end_s: float, status: str = "completed", tpot_ms: float | None = 10.0, tokens: int = 60):
    return {"sent_s": sent_s, "end_s": end_s, "status": status, "tpot_ms": tpot_ms, "completion_tokens": tokens}


def memory(samples: list[tuple[float, str, float, float | None, float | None]]) -> pd.DataFrame:
    return pd.DataFrame(samples, columns=["t_s", "process", "rss_mib", "gpu_mib", "device_used_mib"])


def test_a_record_is_dated_from_the_soak_start_by_its_wall_clock_send_time():
    record = RequestRecord(index=3, kind="long", prompt_len=5, output_len=8, status="completed", start_s=7.0,
                           end_s=9.5, tpot_ms=4.0, itl_ms=[1.0, 2.0], sent_wall_s=1_000_065.0)
    out = record_row(record, origin_wall_s=1_000_000.0)
    assert (out["sent_s"], out["end_s"]) == (65.0, 67.5)
    assert "itl_ms" not in out and out["e2e_ms"] == 2500.0 and out["kind"] == "long"


def test_requests_count_in_the_minute_they_ended_and_late_ones_in_the_drain_row():
    records = [row(1, 30), row(50, 70, tpot_ms=20.0), row(61, 100, "failed", None), row(100, 130),
               row(170, 185, "timed_out", None)]
    rows = minutes(records, memory([]), duration_s=180)  # three minutes, then the drain
    assert [r["minute"] for r in rows] == [1, 2, 3, DRAIN]
    assert [(r["completed"], r["failed"], r["timed_out"]) for r in rows] == [(1, 0, 0), (1, 1, 0), (1, 0, 0), (0, 0, 1)]
    assert [r["submitted"] for r in rows] == [2, 2, 1, 0]  # by when each was sent
    assert sum(r["completed"] + r["failed"] + r["timed_out"] for r in rows) == len(records)
    assert rows[1]["tpot_ms p99"] == 20.0 and rows[0]["tok_s"] == 1.0 and rows[3]["tok_s"] is None


def test_a_collect_while_the_soak_runs_shows_the_minute_under_way_apart_and_judges_whole_minutes_only():
    records = [row(1, 30), row(61, 70), row(100, 130), row(125, 140, tpot_ms=99.0)]
    rows = minutes(records, memory([]), duration_s=1200, elapsed_s=150)
    assert [r["minute"] for r in rows] == [1, 2, "3 (partial)"]
    assert rows[2]["completed"] == 2 and rows[2]["tok_s"] == 4.0  # 120 tokens over the 30 s seen of it
    assert by_goal(goals(rows))["tpot_ms p99 flat"]["ok"] is None  # minute 2 alone: nothing to compare yet
    assert [r["minute"] for r in minutes([], memory([]), duration_s=1200, elapsed_s=0)] == ["1 (partial)"]


def test_memory_is_summed_over_a_lanes_processes_and_averaged_over_the_minute():
    # Two decode processes (one replaced mid-run is another pid of the same lane), one verify.
    samples = [(10, "decode:1", 100.0, 1000.0, 5000.0), (10, "decode:2", 50.0, 500.0, 5000.0),
               (10, "verify:3", 10.0, 2000.0, 5000.0), (40, "decode:1", 110.0, 1000.0, 5100.0),
               (40, "decode:4", 50.0, 500.0, 5100.0), (40, "verify:3", 20.0, 2000.0, 5100.0),
               (70, "decode:1", 300.0, 1000.0, 6000.0)]
    rows = minutes([], memory(samples), duration_s=120)
    assert rows[0]["rss_mib decode"] == 155.0 and rows[0]["rss_mib verify"] == 15.0
    assert rows[0]["gpu_mib decode"] == 1500.0 and rows[0]["device_used_mib"] == 5050.0
    assert rows[1]["rss_mib decode"] == 300.0 and rows[1]["rss_mib verify"] is None


def test_without_nvml_there_are_no_gpu_columns():
    rows = minutes([], memory([(10, "ingress:9", 80.0, None, None)]), duration_s=60)
    assert [c for c in rows[0] if "mib" in c] == ["rss_mib ingress"]


def test_change_from_minute_2_by_its_endpoints_and_by_a_fitted_line():
    moved = change({1: 50.0, 2: 100.0, 3: 101.0, 4: 130.0, 5: 103.0})  # minute 1 (warm-up) left out
    assert moved["from_minute"] == 2 and moved["to_minute"] == 5 and moved["change"] == 0.03
    assert moved["peak"] == 130.0 and 0.03 < moved["fitted_change"] < 0.2
    assert change({1: 1.0, 2: 5.0}) is None and change({2: 0.0, 3: 1.0}) is None


def steady(minute: int, **over) -> dict:
    return {"minute": minute, "submitted": 60, "completed": 60, "failed": 0, "timed_out": 0, "tok_s": 100.0,
            "tpot_ms p50": 10.0, "tpot_ms p99": 20.0, "rss_mib decode": 1000.0, "gpu_mib decode": 9000.0, **over}


def by_goal(checks: list[dict]) -> dict[str, dict]:
    return {g["goal"]: g for g in checks}


def test_a_flat_soak_meets_every_goal():
    rows = [steady(1, **{"rss_mib decode": 500.0})] + [steady(m) for m in range(2, 21)]
    checks = by_goal(goals(rows))
    assert all(g["ok"] for g in checks.values()), checks
    assert set(checks) == {"0 failed or timed out", "tpot_ms p99 flat", "rss_mib decode flat", "gpu_mib decode flat"}


def test_growth_past_the_limits_and_a_failure_in_the_drain_miss_the_goals():
    rows = [steady(m, **{"rss_mib decode": 1000.0 + 2 * m, "tpot_ms p99": 20.0 + 0.2 * m}) for m in range(1, 21)]
    rows.append({**steady(0), "minute": DRAIN, "completed": 3, "failed": 1, "tok_s": None})
    checks = by_goal(goals(rows))
    assert checks["0 failed or timed out"] == {"goal": "0 failed or timed out", "value": 1, "limit": 0, "ok": False}
    assert checks["rss_mib decode flat"]["ok"] is False  # 1004 -> 1040: +3.6 %
    assert checks["tpot_ms p99 flat"]["ok"] is False  # 20.4 -> 24.0: +17.6 %
    assert checks["gpu_mib decode flat"]["ok"] is True
    text = markdown(rows, goals(rows))
    assert "| drain |" in text and "| rss_mib decode flat | +3.6 % |" in text and "| NO |" in text


def test_one_minute_is_too_short_to_judge_flatness():
    checks = by_goal(goals([steady(1), steady(2)]))
    assert checks["tpot_ms p99 flat"]["ok"] is None and checks["0 failed or timed out"]["ok"] is True


def test_a_records_file_cut_off_mid_line_keeps_the_whole_lines(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": ')
    assert read_records(path) == [{"a": 1}, {"a": 2}]
    assert read_records(tmp_path / "missing.jsonl") == []

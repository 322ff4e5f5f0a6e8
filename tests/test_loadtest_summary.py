"""The summary agrees with numbers computed directly from the per-request records."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.records import RequestRecord
from loadtest.spec_stats import SpecDecodeCounters, summarize_spec
from loadtest.summary import parse_slos, summarize


def _records(seed: int = 0, n: int = 300) -> list[RequestRecord]:
    """A run with completed, failed (some before any token, some midway) and timed-out requests."""
    rng = np.random.default_rng(seed)
    records = []
    for index in range(n):
        start_s = float(rng.uniform(0, 20))
        status = rng.choice(["completed"] * 8 + ["failed", "timed_out"])
        tokens = int(rng.integers(1, 200))
        ttft_ms = float(rng.lognormal(5, 0.5))
        itl_ms = rng.lognormal(3, 0.4, size=tokens - 1).tolist()
        e2e_ms = ttft_ms + sum(itl_ms) + float(rng.uniform(0, 5))
        if status == "failed" and index % 2:
            ttft_ms, itl_ms, tokens, e2e_ms = None, [], 0, float(rng.uniform(1, 10))
        records.append(RequestRecord(
            index=index, kind="long" if index % 5 == 0 else "normal", prompt_len=100,
            output_len=200, status=status, start_s=start_s, end_s=start_s + e2e_ms / 1000,
            ttft_ms=ttft_ms, tpot_ms=(e2e_ms - ttft_ms) / (tokens - 1)
            if ttft_ms is not None and tokens > 1 else None,
            itl_ms=itl_ms, completion_tokens=tokens, prompt_tokens=101))
    return records


def test_counts_cover_every_submitted_request():
    records = _records()
    summary = summarize(records, warmup_requests=7)
    statuses = [r.status for r in records]
    assert summary.submitted == len(records)
    assert (summary.completed, summary.failed, summary.timed_out) == (
        statuses.count("completed"), statuses.count("failed"), statuses.count("timed_out"))
    assert summary.completed + summary.failed + summary.timed_out == summary.submitted
    assert summary.failed > 0 and summary.timed_out > 0
    assert summary.warmup_requests == 7


@pytest.mark.parametrize("metric", ["ttft_ms", "tpot_ms", "e2e_ms"])
def test_percentiles_equal_numpy_over_completed_records(metric):
    records = _records()
    values = [getattr(r, metric) for r in records
              if r.status == "completed" and getattr(r, metric) is not None]
    stats = summarize(records).latency_ms[metric]
    assert stats.count == len(values)
    assert stats.mean == pytest.approx(np.mean(values))
    assert [stats.p50, stats.p95, stats.p99] == pytest.approx(
        np.percentile(values, [50, 95, 99]).tolist())


def test_itl_percentiles_pool_every_gap_of_completed_requests():
    records = _records()
    gaps = np.concatenate([r.itl_ms for r in records if r.status == "completed"])
    stats = summarize(records).latency_ms["itl_ms"]
    assert stats.count == gaps.size
    assert [stats.p50, stats.p95, stats.p99] == pytest.approx(
        np.percentile(gaps, [50, 95, 99]).tolist())


def test_per_kind_statistics_use_only_that_kind():
    records = _records()
    long_ttfts = [r.ttft_ms for r in records if r.kind == "long" and r.status == "completed"]
    stats = summarize(records).latency_ms_by_kind["long"]["ttft_ms"]
    assert stats.p95 == pytest.approx(float(np.percentile(long_ttfts, 95)))


def test_throughput_is_over_first_submit_to_last_end_including_failures():
    records = _records()
    wall_s = max(r.end_s for r in records) - min(r.start_s for r in records)
    completed = [r for r in records if r.status == "completed"]
    summary = summarize(records)
    assert summary.wall_s == pytest.approx(wall_s)
    assert summary.request_throughput_rps == pytest.approx(len(completed) / wall_s)
    assert summary.output_token_throughput_tps == pytest.approx(
        sum(r.completion_tokens for r in completed) / wall_s)
    assert summary.total_token_throughput_tps == pytest.approx(
        sum(r.completion_tokens + 101 for r in completed) / wall_s)


def test_requests_in_flight_mean_and_peak_from_the_records():
    records = _records()
    summary = summarize(records)
    origin = min(r.start_s for r in records)
    # On a fine grid: how many requests had started and not yet ended at each instant.
    grid = np.linspace(origin, origin + summary.wall_s, 200_001)[:-1]
    counts = sum(((grid >= r.start_s) & (grid < r.end_s)).astype(int) for r in records)
    assert summary.max_in_flight == counts.max()
    assert summary.mean_in_flight == pytest.approx(counts.mean(), rel=1e-3)
    assert summary.mean_in_flight == pytest.approx(
        sum(r.end_s - r.start_s for r in records) / summary.wall_s)


def test_goodput_counts_completed_requests_meeting_every_slo():
    records = _records()
    slos = parse_slos(["ttft_ms=200", "tpot_ms=25"])
    good = [r for r in records if r.status == "completed" and r.ttft_ms <= 200
            and (r.tpot_ms is None or r.tpot_ms <= 25)]
    summary = summarize(records, slos)
    assert 0 < len(good) < summary.completed  # the SLOs bite, but not on everything
    assert summary.goodput_rps == pytest.approx(len(good) / summary.wall_s)
    assert summarize(records).goodput_rps is None


def test_malformed_slo_is_rejected():
    with pytest.raises(ValueError):
        parse_slos(["ttft=500"])
    with pytest.raises(ValueError):
        parse_slos(["ttft_ms"])


def test_spec_decode_acceptance_from_counter_differences():
    before = SpecDecodeCounters(100, 400, 250, [90, 80, 50, 30])
    after = SpecDecodeCounters(300, 1200, 700, [250, 200, 150, 80, 20])
    spec = summarize_spec(before, after)
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (200, 800, 450)
    assert spec.acceptance_rate == pytest.approx(450 / 800)
    assert spec.mean_acceptance_length == pytest.approx(1 + 450 / 200)
    assert spec.acceptance_rate_per_pos == pytest.approx([160 / 200, 120 / 200, 100 / 200,
                                                          50 / 200, 20 / 200])


def test_no_drafts_gives_no_acceptance_rather_than_zero():
    counters = SpecDecodeCounters(0, 0, 0, [])
    spec = summarize_spec(counters, counters)
    assert spec.acceptance_rate is None and spec.mean_acceptance_length is None

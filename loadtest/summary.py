"""Per-request records -> one run's summary.

- Latency statistics (mean, p50, p95, p99) are over completed requests only: TTFT, TPOT, E2E one
  value per request, ITL every gap of every completed request. Percentiles are numpy's default
  (linear interpolation), so anyone can recompute them from the records.
- Counts cover every submitted request: submitted = completed + failed + timed_out.
- Throughput is over the measured window's wall time, from the first submission to the last
  request's end, failed and timed-out requests included: the run is never cut short.
- Goodput: completed requests meeting every SLO given, per second of that same wall time.
- Requests in flight, as the client sees them (submitted, not yet ended, whatever the status):
  the time-weighted mean over that wall time (sum of E2E / wall time, Little's law) and the peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from loadtest.records import STATUSES, RequestRecord
from loadtest.spec_stats import SpecDecodeSummary

SLO_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")
LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def parse_slos(items: list[str]) -> dict[str, float]:
    """`["ttft_ms=500", "tpot_ms=50"]` -> {"ttft_ms": 500.0, "tpot_ms": 50.0}."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo {item!r}: expected NAME=MS with NAME in {SLO_METRICS}")
        slos[name] = float(value)
    return slos


@dataclass(frozen=True)
class LatencyStats:
    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> LatencyStats:
        if not values:
            return cls(0, None, None, None, None)
        p50, p95, p99 = np.percentile(values, [50, 95, 99])
        return cls(len(values), float(np.mean(values)), float(p50), float(p95), float(p99))


@dataclass(frozen=True)
class Summary:
    submitted: int
    completed: int
    failed: int
    timed_out: int
    warmup_requests: int  # sent before the measured window, excluded from everything else
    wall_s: float
    request_throughput_rps: float  # completed requests per second
    output_token_throughput_tps: float  # completion tokens of completed requests per second
    total_token_throughput_tps: float  # prompt + completion tokens of completed requests
    goodput_rps: float | None  # None when no SLO was given
    mean_in_flight: float  # requests in flight, time-weighted over wall_s
    max_in_flight: int
    slos: dict[str, float]
    latency_ms: dict[str, LatencyStats]  # by metric name: ttft_ms, tpot_ms, itl_ms, e2e_ms
    latency_ms_by_kind: dict[str, dict[str, LatencyStats]]  # the same, per workload kind
    spec_decode: SpecDecodeSummary | None
    spec_decode_error: str | None  # why the server's counters could not be read

    def to_dict(self) -> dict:
        return asdict(self)


def latency_values(records: list[RequestRecord], metric: str) -> list[float]:
    """The values a latency statistic is computed from: completed requests only."""
    completed = [r for r in records if r.status == "completed"]
    if metric == "itl_ms":
        return [gap for r in completed for gap in r.itl_ms]
    values = (getattr(r, metric) for r in completed)
    return [v for v in values if v is not None]


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    if record.status != "completed":
        return False
    for metric, limit_ms in slos.items():
        value = getattr(record, metric)
        # A completed request of one token has no TPOT, so no TPOT can be violated.
        if value is not None and value > limit_ms:
            return False
    return True


def wall_time_s(records: list[RequestRecord]) -> float:
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.start_s for r in records)


def in_flight(records: list[RequestRecord]) -> tuple[float, int]:
    """(time-weighted mean, peak) of the requests in flight over the measured window."""
    wall_s = wall_time_s(records)
    mean = sum(r.end_s - r.start_s for r in records) / wall_s if wall_s > 0 else float(len(records))
    # An end and a start at the same instant: the end first, so the peak is not overstated.
    events = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return mean, peak


def summarize(records: list[RequestRecord], slos: dict[str, float] | None = None, *,
              warmup_requests: int = 0, spec_decode: SpecDecodeSummary | None = None,
              spec_decode_error: str | None = None) -> Summary:
    slos = slos or {}
    counts = {status: sum(r.status == status for r in records) for status in STATUSES}
    completed = [r for r in records if r.status == "completed"]
    wall_s = wall_time_s(records)
    mean_in_flight, max_in_flight = in_flight(records)
    output_tokens = sum(r.completion_tokens for r in completed)
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
                        for r in completed)
    return Summary(
        submitted=len(records), completed=counts["completed"], failed=counts["failed"],
        timed_out=counts["timed_out"], warmup_requests=warmup_requests, wall_s=wall_s,
        request_throughput_rps=_per_s(len(completed), wall_s),
        output_token_throughput_tps=_per_s(output_tokens, wall_s),
        total_token_throughput_tps=_per_s(prompt_tokens + output_tokens, wall_s),
        goodput_rps=_per_s(sum(meets_slos(r, slos) for r in records), wall_s) if slos else None,
        mean_in_flight=mean_in_flight, max_in_flight=max_in_flight,
        slos=slos,
        latency_ms=_latency_stats(records),
        latency_ms_by_kind={kind: _latency_stats([r for r in records if r.kind == kind])
                            for kind in sorted({r.kind for r in records})},
        spec_decode=spec_decode, spec_decode_error=spec_decode_error)


def _latency_stats(records: list[RequestRecord]) -> dict[str, LatencyStats]:
    return {metric: LatencyStats.of(latency_values(records, metric))
            for metric in LATENCY_METRICS}


def _per_s(count: float, wall_s: float) -> float:
    return count / wall_s if wall_s > 0 else 0.0

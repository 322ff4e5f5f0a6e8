"""What a served benchmark sends and how long it should take: loads, the warm-up burst, mixed traffic,
and what a load's records say beyond the load tester's summary (decode stall, acceptance, in flight)."""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtest.arrivals import Arrivals, ClosedLoop, OpenLoop
from loadtest.client import RequestOptions
from loadtest.records import RequestRecord
from loadtest.report import Point
from loadtest.spec_stats import SpecDecodeCounters
from loadtest.summary import Summary
from loadtest.workload import LogNormal, WorkloadRequest, mix_long_prompts, synthetic

# Mixed traffic: a share of long prompts among short ones, every output the same length. The CPU sizes
# only prove the path.
MIXED = {"cuda": dict(prompt=128, output=128, long=3000, long_share=0.1),
         "cpu": dict(prompt=16, output=8, long=96, long_share=0.1)}


@dataclass(frozen=True)
class Load:
    """One point of an app's run: these requests, at fixed arrivals or Poisson at `factor` x the
    completed requests/s of an earlier point of the same app (`rate_of`)."""

    name: str
    requests: list[WorkloadRequest]
    arrivals: Arrivals | None = None
    rate_of: str | None = None
    factor: float = 1.0
    measured: bool = True  # False: a warm-up, kept in the results but out of the goals
    # What every request sends besides its prompt (sampling, logprobs, penalties, response_format, ...).
    options: RequestOptions = RequestOptions()

    def resolve(self, done: dict[str, Summary]) -> Arrivals | None:
        if self.arrivals is not None:
            return self.arrivals
        rate = done[self.rate_of].request_throughput_rps if self.rate_of in done else 0.0
        return OpenLoop(self.factor * rate) if rate > 0 else None


def exactly(tokens: int) -> LogNormal:
    return LogNormal(tokens, 0.0, tokens, tokens)


def warmup_requests(tokenizer: Any, count: int, seed: int, prompts: LogNormal, long_prompts: int = 0,
                    long_prompt_len: int = 0) -> list[WorkloadRequest]:
    """A burst of `count` requests (the app's decode slots), `long_prompts` of them `long_prompt_len`
    tokens long, so that an app meets long prompts first in its warm-up."""
    # Outputs of 4-64 tokens end at different times, so the batch passes every bucket going down.
    burst = synthetic(tokenizer, count, seed, prompts, LogNormal(24, 0.6, 4, 64))
    return mix_long_prompts(burst, long_prompts / len(burst), long_prompt_len, tokenizer, seed + 1)


def mixed_requests(tokenizer: Any, count: int, seed: int, device: str) -> list[WorkloadRequest]:
    """Mixed traffic (MIXED): short prompts, a share of them replaced by long ones ("long" kind)."""
    size = MIXED[device]
    short = synthetic(tokenizer, count, seed, exactly(size["prompt"]), exactly(size["output"]))
    return mix_long_prompts(short, size["long_share"], size["long"], tokenizer, seed + 1)


def estimate_s(load: Load, arrivals: Arrivals, done: dict[str, Summary],
               warmups: frozenset[str] = frozenset()) -> float:
    """How long a load should take, from the closest earlier point (0 before any). Warm-up points
    (`warmups`, slowed by graph capture and compilation) count only while nothing else has run. A closed
    loop above every measured concurrency scales the nearest point's throughput by the root of the
    concurrency ratio (decoding gains nearly linearly with batch while memory-bound; the root keeps a margin)."""
    points = {name: s for name, s in done.items() if name not in warmups} or done
    measured = [s for s in points.values() if s.output_token_throughput_tps > 0]
    if not measured:
        return 0.0
    in_flight = arrivals.concurrency if isinstance(arrivals, ClosedLoop) else max(s.mean_in_flight for s in measured)
    nearest = min(measured, key=lambda s: abs(s.mean_in_flight - in_flight))
    tps = nearest.output_token_throughput_tps
    if isinstance(arrivals, ClosedLoop) and in_flight > nearest.mean_in_flight > 0:
        tps *= math.sqrt(in_flight / nearest.mean_in_flight)
    work_s = sum(r.output_len for r in load.requests) / tps
    arrival_s = len(load.requests) / arrivals.rate_rps if isinstance(arrivals, OpenLoop) else 0.0
    last_request_s = (nearest.latency_ms["e2e_ms"].p50 or 0.0) / 1000
    return max(work_s, arrival_s + last_request_s)


def request_spec_counters(records: list[RequestRecord]) -> SpecDecodeCounters:
    """vLLM's spec-decode counters summed over the completed requests' own usage.spec_decode (behind several
    ingress replicas, the server's totals are one replica's)."""
    done = [r for r in records if r.status == "completed" and r.num_draft_tokens]
    return SpecDecodeCounters(sum(r.num_drafts for r in done), sum(r.num_draft_tokens for r in done),
                              sum(r.num_accepted_tokens for r in done), [])


def decode_stall_ms(point: Point, quantile: float = 99) -> float | None:
    """p`quantile` over completed short requests of each one's longest gap between two stream chunks."""
    gaps = [max(r.itl_ms) for r in point.result.records if r.kind == "normal" and r.status == "completed" and r.itl_ms]
    return float(np.percentile(gaps, quantile)) if gaps else None

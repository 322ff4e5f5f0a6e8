"""One load run against one server: warm-up, then the measured window, every request accounted for.

A run ends when every submitted request has ended (completed, failed or timed out): a duration
bounds when requests are *submitted*, never cuts off the ones in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from loadtest.arrivals import Arrivals, ClosedLoop, OpenLoop, RampLoop
from loadtest.client import (RequestOptions, build_payload, fetch_model_id, fetch_spec_counters,
                             send_request)
from loadtest.records import RequestRecord
from loadtest.spec_stats import SpecDecodeCounters, SpecDecodeSummary, summarize_spec
from loadtest.summary import Summary, summarize
from loadtest.workload import WorkloadRequest


@dataclass
class RunResult:
    base_url: str
    model: str
    arrivals: Arrivals
    records: list[RequestRecord]  # the measured window, one per submitted request
    warmup_records: list[RequestRecord]  # excluded from the summary, counted
    spec_before: SpecDecodeCounters | None = None
    spec_after: SpecDecodeCounters | None = None
    spec_error: str | None = None
    started_unix_s: float = 0.0  # wall clock when the run began (warm-up included)

    @property
    def spec_decode(self) -> SpecDecodeSummary | None:
        if self.spec_before is None or self.spec_after is None:
            return None
        return summarize_spec(self.spec_before, self.spec_after)

    def summary(self, slos: dict[str, float] | None = None) -> Summary:
        return summarize(self.records, slos, warmup_requests=len(self.warmup_records),
                         spec_decode=self.spec_decode, spec_decode_error=self.spec_error)


async def run_load(base_url: str, workload: list[WorkloadRequest], arrivals: Arrivals, *,
                   duration_s: float | None = None, warmup: list[WorkloadRequest] | None = None,
                   options: RequestOptions = RequestOptions(), timeout_s: float = 300.0,
                   seed: int = 0, progress: bool = True,
                   on_record: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Drive `base_url` with `workload` at `arrivals` and record every request.

    Without `duration_s` each workload request is sent once; with it, requests are sent (the
    workload cycled) until `duration_s` has passed, and the run waits for those in flight.
    `warmup` requests go first with the same arrivals and are left out of the measured window.
    `on_record` is called with each measured request's record as it ends (a soak writes them as
    they come, so that a run cut short keeps them).
    """
    if not workload:
        raise ValueError("empty workload")
    base_url = base_url.rstrip("/")
    started_unix_s = time.time()
    # No connection cap: a client-side queue would add its own wait to TTFT.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as http:
        model = options.model or await fetch_model_id(http, base_url)
        send = _sender(http, base_url, options, model, timeout_s, seed)
        warmup_records = await _drive(send, warmup or [], arrivals, None, seed,
                                      _bar(progress, "warm-up", len(warmup or [])))
        spec_before, error_before = await fetch_spec_counters(http, base_url)
        total = len(workload) if duration_s is None else None
        records = await _drive(send, workload, arrivals, duration_s, seed,
                               _bar(progress, arrivals.label, total), on_record)
        spec_after, error_after = await fetch_spec_counters(http, base_url)
    return RunResult(base_url=base_url, model=model, arrivals=arrivals, records=records,
                     warmup_records=warmup_records, spec_before=spec_before,
                     spec_after=spec_after, spec_error=error_before or error_after,
                     started_unix_s=started_unix_s)


Send = Callable[[int, WorkloadRequest, float], Coroutine[Any, Any, RequestRecord]]


def _sender(http: httpx.AsyncClient, base_url: str, options: RequestOptions, model: str,
            timeout_s: float, seed: int) -> Send:
    def send(index: int, request: WorkloadRequest,
             origin_s: float) -> Coroutine[Any, Any, RequestRecord]:
        # A per-request seed makes sampled (temperature > 0) runs repeatable.
        payload = build_payload(request, options, model, seed=seed + index)
        return send_request(http, base_url, payload, index=index, request=request,
                            endpoint=options.endpoint, timeout_s=timeout_s, origin_s=origin_s)
    return send


def _bar(enabled: bool, label: str, total: int | None) -> tqdm:
    return tqdm(total=total, desc=label, unit="req", disable=not enabled or total == 0)


async def _drive(send: Send, workload: list[WorkloadRequest], arrivals: Arrivals, duration_s: float | None,
                 seed: int, bar: tqdm, on_record: Callable[[RequestRecord], None] | None = None
                 ) -> list[RequestRecord]:
    if not workload:
        return []

    def ended(record: RequestRecord) -> None:
        bar.update(1)
        if on_record is not None:
            on_record(record)

    with bar:
        if isinstance(arrivals, OpenLoop | RampLoop):
            records = await _open_loop(send, workload, arrivals, duration_s, seed, ended)
        else:
            records = await _closed_loop(send, workload, arrivals, duration_s, ended)
    return sorted(records, key=lambda r: r.index)


def _requests(workload: list[WorkloadRequest], duration_s: float | None
              ) -> Iterator[tuple[int, WorkloadRequest]]:
    source = workload if duration_s is None else itertools.cycle(workload)
    return enumerate(source)


async def _open_loop(send: Send, workload: list[WorkloadRequest], arrivals: OpenLoop | RampLoop,
                     duration_s: float | None, seed: int,
                     ended: Callable[[RequestRecord], None]) -> list[RequestRecord]:
    gaps_s = arrivals.gaps_s(np.random.default_rng(seed))
    origin_s = time.perf_counter()
    due_s = 0.0  # the first request goes at once, each later one a gap after the previous
    tasks: list[asyncio.Task] = []
    for index, request in _requests(workload, duration_s):
        if index > 0:
            due_s += next(gaps_s)
        if duration_s is not None and due_s >= duration_s:
            break
        await asyncio.sleep(max(0.0, origin_s + due_s - time.perf_counter()))
        # A busy host may wake us past the end: `duration_s` bounds when requests are sent, not when due.
        if duration_s is not None and time.perf_counter() - origin_s >= duration_s:
            break
        task = asyncio.create_task(send(index, request, origin_s))
        task.add_done_callback(lambda done: ended(done.result()))
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


async def _closed_loop(send: Send, workload: list[WorkloadRequest], arrivals: ClosedLoop,
                       duration_s: float | None, ended: Callable[[RequestRecord], None]) -> list[RequestRecord]:
    origin_s = time.perf_counter()
    pending = _requests(workload, duration_s)
    records: list[RequestRecord] = []

    async def worker() -> None:
        # The iterator is shared; asyncio runs one worker at a time, so next() never races.
        for index, request in pending:
            if duration_s is not None and time.perf_counter() - origin_s >= duration_s:
                return
            records.append(await send(index, request, origin_s))
            ended(records[-1])

    await asyncio.gather(*(worker() for _ in range(arrivals.concurrency)))
    return records

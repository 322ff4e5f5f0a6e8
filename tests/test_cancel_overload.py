"""Cancellations at random points and overload, in pdv and unified (CPU, tiny pair, a real Serve
instance; issue 15, item 3).

Cancellations: streamed requests, `VPD_CANCEL_COUNT` per mode (CI: 200, as issue 15 asks; 12 in flight at a time),
each cancelled by its client at a seeded random point: right after sending (before any token),
mid-stream (after k chunks), or while a long prompt is prefilling (before its first token reaches
the client; in pdv while the prefill lane has it or hands its KV over). Then no lane holds a slot,
`/v1/lanes` says so, and the app serves the same greedy output.

Overload: 10x as many concurrent streams as the app admits (`max_queued_requests`), for `VPD_OVERLOAD_S`
seconds (CI: 15, the burst issue 15 asks of CI; the long run below holds it 120 s), each admitted one about
ADMITTED_HOLD_S long at the speed the app is measured to serve just before, so that refusals outnumber admissions
on a fast machine as on a slow one. Every response is a 200 stream that completes, or a 429 with `Retry-After` in
OpenAI's error shape; no 5xx; each request ends within a bound; `/v1/lanes`, sampled during the load, never shows
a queue past the admission bound; after it every slot is free and every replica's RSS is back near its start
(RSS_SLACK_MB, RSS_SLACK_FRACTION). A burst of plain (not streamed) requests, three times the bound at once, in
unified: the same answers, without streams.

Long runs: `VPD_CANCEL_COUNT=1000 VPD_OVERLOAD_S=120 pytest tests/test_cancel_overload.py`
(results in docs/serving.md, "Cancellation and overload").
"""

import asyncio
import json
import os
import random
import time

import httpx
import psutil
import pytest

from tests.serve_helpers import HTTP_PORT, MODEL, app_config, base_url, greedy_choice, serving, wait_until_idle

pytestmark = pytest.mark.serve

MODES = ("pdv", "unified")
CANCEL_COUNT = int(os.environ.get("VPD_CANCEL_COUNT", "200"))  # per mode
CANCEL_IN_FLIGHT = 12  # below MAX_QUEUED: a client gone must give its admission back at once
OVERLOAD_S = float(os.environ.get("VPD_OVERLOAD_S", "15"))
MAX_QUEUED = 16  # the app admits this many requests at once; more get 429
MAX_NUM_SEQS = 8
OVERLOAD_CLIENTS = 10 * MAX_QUEUED
REQUEST_BOUND_S = 60.0  # no admitted request of the overload may take longer than this
# An admitted request of the overload holds its slot for about this long at the speed measured just before it
# (under the overload itself it runs 3-4x longer: 2 s measured gave 5.5-6.7 s p50), sized from that speed:
# refused clients retry every 0.05-0.2 s, so 429s outnumber 200s however fast the machine serves.
ADMITTED_HOLD_S = 1.0
RSS_SLACK_MB, RSS_SLACK_FRACTION = 50.0, 0.10  # "back near its start": within the larger of the two
LONG_PROMPT = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 24  # ~600 tokens


@pytest.fixture(scope="module", autouse=True)
def apps(pair_paths):
    target, draft = pair_paths
    configs = {}
    for mode in MODES:
        configs[mode] = app_config(mode, target, draft, max_queued_requests=MAX_QUEUED)
        configs[mode]["engine"].update(max_model_len=1024, max_num_seqs=MAX_NUM_SEQS)
    with serving(configs):
        yield


def _lanes(mode: str) -> dict:
    r = httpx.get(f"{base_url(mode)}/lanes", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def assert_lanes_idle(mode: str) -> dict:
    lanes = _lanes(mode)["lanes"]
    for r in lanes["decode"]["replicas"]:
        assert r["running"] == r["queue_depth"] == r["draft_slots_used"] == r["prefills_in_flight"] == 0, lanes
        assert r["target_slots_used"] in (0, None), lanes
    if mode == "pdv":
        assert lanes["verify"]["replicas"][0]["kv_slots_used"] == 0, lanes
        assert lanes["verify"]["replicas"][0]["queue_depth"] == 0, lanes
        assert lanes["prefill"]["replicas"][0]["queue_depth"] == 0, lanes
    return lanes


def _handed_over(mode: str) -> int:
    """Prompts the prefill lane has handed over since it started (0 outside pdv)."""
    if mode != "pdv":
        return 0
    return sum(sum(r["handed_over"].values()) for r in _lanes(mode)["lanes"]["prefill"]["replicas"])


# ---- cancellations -----------------------------------------------------------------------------


def _request_bytes(mode: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST /{mode}/v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{HTTP_PORT}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


async def _send_and_leave(mode: str, body: dict, delay_s: float) -> bool:
    """Send the request on a raw connection, wait `delay_s`, close it. True when the response's
    first byte had arrived by then (the ingress answers only once the first token exists)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", HTTP_PORT)
    writer.write(_request_bytes(mode, body))
    await writer.drain()
    try:
        await asyncio.wait_for(reader.read(1), delay_s)
        answered = True
    except TimeoutError:
        answered = False
    writer.close()
    await writer.wait_closed()
    return answered


async def _read_chunks_and_leave(http: httpx.AsyncClient, mode: str, body: dict, k: int) -> int:
    chunks = 0
    async with http.stream("POST", f"{base_url(mode)}/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            chunks += line.startswith("data: {")
            if chunks == k:
                break  # leaving the block closes the connection: the client is gone
    return chunks


async def _cancel(http, mode: str, i: int, rng: random.Random, long_ttft_s: float) -> str:
    # The run ends with a burst of prefill-time cancellations: no later request may be needed to free
    # what they held (a prefill reply that lands after its request was aborted).
    tail = i >= CANCEL_COUNT - CANCEL_IN_FLIGHT
    kind = "prefilling" if tail else rng.choice(("before_first_token", "mid_stream", "prefilling"))
    body = {"model": MODEL, "prompt": f"for i in range({i}):", "max_tokens": 400, "ignore_eos": True,
            "stream": True, "temperature": rng.choice((0.0, 0.8)), "seed": i}
    if kind == "before_first_token":
        await _send_and_leave(mode, body, 0.0)
    elif kind == "mid_stream":
        await _read_chunks_and_leave(http, mode, body, rng.randint(1, 6))
    else:
        body["prompt"] = LONG_PROMPT + f"# {i}\n"
        if await _send_and_leave(mode, body, rng.uniform(0.1, 0.9) * long_ttft_s):
            kind = "prefilling (too late: answered)"
    return kind


async def _prefill_cancellations(mode: str, long_ttft_s: float) -> list[str]:
    """CANCEL_IN_FLIGHT long prompts at once, each left at 0.5 to 2 times `long_ttft_s`."""
    rng = random.Random(16)

    async def one(i: int) -> str:
        body = {"model": MODEL, "prompt": LONG_PROMPT + f"# late {i}\n", "max_tokens": 400, "ignore_eos": True,
                "stream": True, "temperature": 0.0}
        answered = await _send_and_leave(mode, body, rng.uniform(0.5, 2.0) * long_ttft_s)
        return "prefilling (too late: answered)" if answered else "prefilling"

    return list(await asyncio.gather(*(one(i) for i in range(CANCEL_IN_FLIGHT))))


def _long_prompt_ttft_s(mode: str) -> float:
    """Median time to the first response byte of a long prompt with CANCEL_IN_FLIGHT of them at once."""
    async def one(http):
        start = time.monotonic()
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1, "stream": True}
        async with http.stream("POST", f"{base_url(mode)}/completions", json=body) as r:
            assert r.status_code == 200
            return time.monotonic() - start

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            return sorted(await asyncio.gather(*(one(http) for _ in range(CANCEL_IN_FLIGHT))))

    return asyncio.run(main())[CANCEL_IN_FLIGHT // 2]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_random_cancellations_free_every_slot_and_the_app_serves_the_same(mode):
    greedy_before = greedy_choice(mode, "def add(a, b):", 24, return_token_ids=True)["token_ids"]
    long_ttft_s = _long_prompt_ttft_s(mode)
    wait_until_idle(mode, mode)
    handed_over_before = _handed_over(mode)
    rng = random.Random(15)
    gate = asyncio.Semaphore(CANCEL_IN_FLIGHT)

    async def one(http, i):
        async with gate:
            return await _cancel(http, mode, i, rng, long_ttft_s)

    async def main():
        limits = httpx.Limits(max_connections=CANCEL_IN_FLIGHT, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(CANCEL_COUNT)))

    start = time.monotonic()
    kinds = asyncio.run(main())
    sent_s = time.monotonic() - start
    stats = wait_until_idle(mode, mode, timeout_s=30)
    idle_s = time.monotonic() - start - sent_s
    assert_lanes_idle(mode)
    counts = {k: kinds.count(k) for k in sorted(set(kinds))}
    # In pdv: prompts the prefill lane handed over for requests whose client had already left
    # (before its first token): the hand-over's landing on an aborted request gave the slot back.
    unanswered = counts.get("before_first_token", 0) + counts.get("prefilling", 0)
    handed_over = _handed_over(mode) - handed_over_before
    print(f"{mode}: {CANCEL_COUNT} cancellations in {sent_s:.1f} s ({counts}); long-prompt TTFT "
          f"{long_ttft_s * 1e3:.0f} ms; prefill hand-overs {handed_over}; idle {idle_s:.1f} s after the last")
    assert counts.get("prefilling", 0) >= CANCEL_COUNT // 10, counts  # the hand-over point was reached
    if mode == "pdv":
        answered = CANCEL_COUNT - unanswered  # mid-stream ones, and prefilling ones left too late
        for _ in range(3):
            if handed_over > answered:
                break
            # No client left while its prompt was in the prefill lane: on a busy host the cancellations
            # timed from the TTFT measured above all came before their prefill began. Bursts of
            # cancellations timed later (up to 2x that TTFT) reach the hand-over point.
            kinds = asyncio.run(_prefill_cancellations(mode, long_ttft_s))
            answered += kinds.count("prefilling (too late: answered)")
            wait_until_idle(mode, mode, timeout_s=30)
            handed_over = _handed_over(mode) - handed_over_before
        assert handed_over > answered, (handed_over, answered, counts)
        assert_lanes_idle(mode)
    assert stats and greedy_choice(mode, "def add(a, b):", 24, return_token_ids=True)["token_ids"] == greedy_before
    wait_until_idle(mode, mode)


# ---- overload ----------------------------------------------------------------------------------


def _replica_pids(mode: str) -> dict[str, int]:
    """Every process of the app that holds request state: the ingress, each lane replica and, in
    unified, the engine process."""
    report = _lanes(mode)
    pids = {"ingress": report["ingress_pid"]}
    for lane, body in report["lanes"].items():
        for i, r in enumerate(body["replicas"]):
            pids[f"{lane}{i}"] = r["replica_pid"]
            if r.get("engine_pid") not in (None, r["replica_pid"]):
                pids[f"{lane}{i}-engine"] = r["engine_pid"]
    return pids


def _rss_mb(pids: dict[str, int]) -> dict[str, float]:
    return {name: psutil.Process(pid).memory_info().rss / 2**20 for name, pid in pids.items()}


def _tokens_per_admitted_request(mode: str) -> int:
    """max_tokens that keeps an admitted stream ADMITTED_HOLD_S long: MAX_QUEUED streams of 32 tokens at once
    (the overload's admitted concurrency) give one stream's tokens/s on this machine now."""
    probe_tokens = 32

    async def one(http, i):
        body = {"model": MODEL, "prompt": f"import sys{i}", "max_tokens": probe_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0.0}
        start = time.monotonic()
        async with http.stream("POST", f"{base_url(mode)}/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for _ in r.aiter_lines():
                pass
        return time.monotonic() - start

    async def main():
        async with httpx.AsyncClient(timeout=REQUEST_BOUND_S) as http:
            return sorted(await asyncio.gather(*(one(http, i) for i in range(MAX_QUEUED))))

    stream_s = asyncio.run(main())[MAX_QUEUED // 2]
    return max(16, min(480, round(ADMITTED_HOLD_S * probe_tokens / stream_s)))


async def _overload_client(http, mode: str, i: int, deadline: float, rng: random.Random, results: list,
                           mean_tokens: int) -> None:
    while time.monotonic() < deadline:
        max_tokens = rng.randint(mean_tokens // 2, mean_tokens * 3 // 2)
        body = {"model": MODEL, "prompt": f"import os{i}", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
        start = time.monotonic()
        status, retry_after, error, events = None, None, None, []
        try:
            async with http.stream("POST", f"{base_url(mode)}/completions", json=body) as r:
                status, retry_after = r.status_code, r.headers.get("retry-after")
                if status == 200:
                    events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
                else:
                    error = json.loads(await r.aread()).get("error")
        except httpx.HTTPError as exc:
            status = f"transport error {exc!r}"
        results.append((status, retry_after, error, events, max_tokens, time.monotonic() - start))
        if status == 429:
            await asyncio.sleep(rng.uniform(0.05, 0.2))  # far sooner than Retry-After: the load stays at 10x


async def _sample_lanes(mode: str, deadline: float, samples: list) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() < deadline:
            samples.append((await http.get(f"{base_url(mode)}/lanes")).json())
            await asyncio.sleep(0.5)


def _queue_depths(sample: dict) -> dict[str, int]:
    """Requests each lane holds beyond those it is working on, summed over its replicas; and the
    decode lane's requests in all (running + queued)."""
    lanes = sample["lanes"]
    depths = {lane: sum(r["queue_depth"] for r in body["replicas"]) for lane, body in lanes.items()}
    depths["decode_held"] = sum(r["running"] + r["queue_depth"] for r in lanes["decode"]["replicas"])
    depths["decode_running_max"] = max(r["running"] for r in lanes["decode"]["replicas"])
    return depths


def _assert_refused(retry_after: str | None, error: dict) -> None:
    """A 429 as the ingress refuses past its admission bound: `Retry-After: 1` and OpenAI's error shape."""
    assert retry_after == "1" and error["type"] == "rate_limit_error" and error["code"] == 429, (retry_after, error)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_overload_gets_429s_bounded_queues_no_5xx_no_hang_and_memory_back(mode):
    greedy_choice(mode, "def add(a, b):", 24, return_token_ids=True)["token_ids"]  # warm: first requests allocate buffers that stay
    mean_tokens = _tokens_per_admitted_request(mode)
    wait_until_idle(mode, mode)
    pids = _replica_pids(mode)
    rss_before = _rss_mb(pids)
    rng = random.Random(16)
    results, samples = [], []

    async def main():
        deadline = time.monotonic() + OVERLOAD_S
        limits = httpx.Limits(max_connections=OVERLOAD_CLIENTS + 1)
        async with httpx.AsyncClient(timeout=REQUEST_BOUND_S, limits=limits) as http:
            await asyncio.gather(_sample_lanes(mode, deadline, samples),
                                 *(_overload_client(http, mode, i, deadline, rng, results, mean_tokens)
                                   for i in range(OVERLOAD_CLIENTS)))

    start = time.monotonic()
    asyncio.run(main())
    load_s = time.monotonic() - start
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429}, sorted({str(s) for s in statuses})
    for status, retry_after, error, events, max_tokens, took_s in results:
        assert took_s < REQUEST_BOUND_S
        if status == 429:
            _assert_refused(retry_after, error)
        else:
            assert events[-1] == "[DONE]" and '"error"' not in events[-2], events[-2:]
            assert json.loads(events[-2])["usage"]["completion_tokens"] == max_tokens
    ok = statuses.count(200)
    assert ok >= MAX_QUEUED and statuses.count(429) > ok, (ok, statuses.count(429))
    depths = [_queue_depths(s) for s in samples]
    peak = {key: max(d[key] for d in depths) for key in depths[0]}
    assert len(samples) >= OVERLOAD_S / 5, len(samples)
    assert peak["decode_held"] <= MAX_QUEUED and peak["decode_running_max"] <= MAX_NUM_SEQS, peak
    assert all(peak[lane] <= MAX_QUEUED for lane in samples[0]["lanes"]), peak

    wait_until_idle(mode, mode, timeout_s=30)
    assert_lanes_idle(mode)
    assert _replica_pids(mode) == pids  # no replica was replaced under the load
    rss_after = _rss_mb(pids)
    growth = {name: rss_after[name] - rss_before[name] for name in pids}
    took = sorted(r[5] for r in results if r[0] == 200)
    print(f"{mode}: {len(results)} requests in {load_s:.0f} s from {OVERLOAD_CLIENTS} clients: {ok} x 200, "
          f"{statuses.count(429)} x 429 (max_tokens around {mean_tokens}); "
          f"200s took p50 {took[len(took) // 2]:.2f} s, max {took[-1]:.2f} s; "
          f"peak depths {peak} over {len(samples)} samples; RSS MB before "
          f"{ {k: round(v) for k, v in rss_before.items()} }, growth { {k: round(v, 1) for k, v in growth.items()} }")
    for name in pids:
        assert growth[name] <= max(RSS_SLACK_MB, RSS_SLACK_FRACTION * rss_before[name]), (name, growth)


def test_plain_requests_past_the_admission_bound_get_429_with_retry_after_and_the_admitted_complete():
    """Not streamed, at once, three times as many as unified admits: at least MAX_QUEUED are admitted and complete
    with every token asked for; the rest get a 429 with `Retry-After` in OpenAI's error shape (the overload test
    above proves the same of streams, under sustained load)."""
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 120, "ignore_eos": True}

    async def main():
        limits = httpx.Limits(max_connections=3 * MAX_QUEUED)
        async with httpx.AsyncClient(timeout=REQUEST_BOUND_S, limits=limits) as http:
            return await asyncio.gather(*(http.post(f"{base_url('unified')}/completions", json=body)
                                          for _ in range(3 * MAX_QUEUED)))

    responses = asyncio.run(main())
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= MAX_QUEUED and 429 in statuses and set(statuses) <= {200, 429}, statuses
    for r in responses:
        if r.status_code == 429:
            _assert_refused(r.headers["retry-after"], r.json()["error"])
        else:
            assert r.json()["usage"]["completion_tokens"] == 120
    wait_until_idle("unified", "unified", timeout_s=30)

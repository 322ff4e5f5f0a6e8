"""Streaming client for the OpenAI-style endpoints: one request in, one `RequestRecord` out.

Timing is taken on the client, as a user sees it: TTFT is the time from sending the request to
the first chunk that carries text; inter-token latencies are the gaps between successive
text-carrying chunks (with speculative decoding one chunk can carry several tokens, as in vLLM's
benchmark); TPOT is (e2e - TTFT) / (completion_tokens - 1) with the server's usage count.

A request never raises: HTTP errors, error chunks, broken streams and exceptions become status
"failed" with the error text, and a request still running after `timeout_s` becomes "timed_out".
No retries: a 429 is a result of the load, not something to hide.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from loadtest.records import RequestRecord
from loadtest.spec_stats import SpecDecodeCounters
from loadtest.workload import WorkloadRequest

Endpoint = Literal["completions", "chat"]
_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run sends besides its prompt and length."""

    endpoint: Endpoint = "completions"
    model: str | None = None  # None: the first id of GET /v1/models
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    # Keep generating to max_tokens, so output lengths follow the workload, not the model's EOS.
    ignore_eos: bool = True
    # More request fields, sent as given (logprobs, penalties, response_format, ...); they win over the above.
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(request: WorkloadRequest, options: RequestOptions, model: str,
                  seed: int) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "ignore_eos": options.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": seed,
    }
    if options.top_k is not None:
        payload["top_k"] = options.top_k
    if options.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    payload.update(options.extra_body)
    return payload


@dataclass(frozen=True)
class SseEvent:
    """One parsed `data:` line: a chunk's text and usage, an error, or the end marker."""

    text: str = ""
    usage: dict | None = None
    error: str | None = None
    done: bool = False
    response_id: str | None = None  # the response's `id` (the server's request id)


def parse_sse_line(line: str) -> SseEvent | None:
    """Parse one line of an SSE stream; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return SseEvent(done=True)
    body = json.loads(data)
    if "error" in body:
        return SseEvent(error=_error_text(body["error"]))
    return SseEvent(text=_chunk_text(body), usage=body.get("usage"), response_id=body.get("id"))


def _chunk_text(body: dict) -> str:
    choices = body.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:  # chat completions
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return f"{error.get('type', 'error')}: {error.get('message', '')}"
    return str(error)


@dataclass
class _Stream:
    """What has arrived so far; kept outside the try so a timeout keeps partial timings."""

    chunk_times_s: list[float] = field(default_factory=list)
    usage: dict | None = None
    error: str | None = None
    done: bool = False
    http_status: int | None = None
    response_id: str | None = None
    under_way: asyncio.Event | None = None

    def take(self, event: SseEvent, now_s: float) -> None:
        self.response_id = self.response_id or event.response_id
        if event.text:
            self.chunk_times_s.append(now_s)
            if self.under_way is not None:
                self.under_way.set()
        if event.usage is not None:
            self.usage = event.usage
        self.error = event.error or self.error
        self.done = self.done or event.done


async def send_request(http: httpx.AsyncClient, base_url: str, payload: dict, *, index: int,
                       request: WorkloadRequest, endpoint: Endpoint, timeout_s: float,
                       origin_s: float, under_way: asyncio.Event | None = None) -> RequestRecord:
    """Send one streaming request and record what happened; times relative to `origin_s`.
    `under_way` is set at its first text chunk, or when it ends without one (loadtest/faults.py)."""
    stream = _Stream(under_way=under_way)
    sent_wall_s = time.time()  # the server's timelines use the wall clock (deployments/telemetry/timeline.py)
    start_s = time.perf_counter()
    status, error = "failed", None
    try:
        async with asyncio.timeout(timeout_s):
            await _consume(http, base_url + _PATHS[endpoint], payload, stream)
        status, error = _outcome(stream)
    except (TimeoutError, httpx.TimeoutException):
        status, error = "timed_out", f"no complete answer within {timeout_s:g} s"
    except Exception as exc:  # connection refused, reset, malformed chunk: the request failed
        error = f"{type(exc).__name__}: {exc}"
    end_s = time.perf_counter()
    if under_way is not None:
        under_way.set()
    record = _record(index, request, stream, status, error, start_s, end_s, origin_s)
    record.response_id, record.sent_wall_s = stream.response_id, sent_wall_s
    return record


async def _consume(http: httpx.AsyncClient, url: str, payload: dict, stream: _Stream) -> None:
    async with http.stream("POST", url, json=payload) as response:
        stream.http_status = response.status_code
        if response.status_code != 200:
            stream.error = _http_error_text(response.status_code, await response.aread())
            return
        async for line in response.aiter_lines():
            event = parse_sse_line(line)
            if event is not None:
                stream.take(event, time.perf_counter())
            if stream.done or stream.error:
                return


def _http_error_text(status_code: int, body: bytes) -> str:
    try:
        return f"HTTP {status_code} " + _error_text(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status_code}: {body[:200].decode(errors='replace')}"


def _outcome(stream: _Stream) -> tuple[str, str | None]:
    if stream.error is not None:
        return "failed", stream.error
    if not stream.done:
        return "failed", "stream ended without [DONE]"
    return "completed", None


def _record(index: int, request: WorkloadRequest, stream: _Stream, status: str,
            error: str | None, start_s: float, end_s: float, origin_s: float) -> RequestRecord:
    # All times are perf_counter readings: chunk times become offsets from this request's
    # start, start and end offsets from the measured window's origin.
    times_s = [t - start_s for t in stream.chunk_times_s]
    usage = stream.usage or {}
    completion_tokens = usage.get("completion_tokens", len(times_s))
    e2e_ms = (end_s - start_s) * 1000.0
    ttft_ms = times_s[0] * 1000.0 if times_s else None
    spec = usage.get("spec_decode") or {}
    return RequestRecord(
        index=index, kind=request.kind, prompt_len=request.prompt_len,
        output_len=request.output_len, status=status, start_s=start_s - origin_s,
        end_s=end_s - origin_s,
        ttft_ms=ttft_ms,
        tpot_ms=(e2e_ms - ttft_ms) / (completion_tokens - 1)
        if ttft_ms is not None and completion_tokens > 1 else None,
        itl_ms=[(b - a) * 1000.0 for a, b in zip(times_s, times_s[1:])],
        completion_tokens=completion_tokens, prompt_tokens=usage.get("prompt_tokens"),
        http_status=stream.http_status, error=error,
        num_drafts=spec.get("num_drafts"), num_draft_tokens=spec.get("num_draft_tokens"),
        num_accepted_tokens=spec.get("num_accepted_tokens"))


async def fetch_model_id(http: httpx.AsyncClient, base_url: str) -> str:
    """The first model id the server lists at GET /v1/models."""
    response = await http.get(base_url + "/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def fetch_spec_counters(http: httpx.AsyncClient, base_url: str
                              ) -> tuple[SpecDecodeCounters | None, str | None]:
    """The server's spec-decode totals, or None and why they could not be read."""
    try:
        response = await http.get(base_url + "/v1/spec_decode/stats")
        response.raise_for_status()
        return SpecDecodeCounters.from_json(response.json()), None
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return None, f"{type(exc).__name__}: {exc}"

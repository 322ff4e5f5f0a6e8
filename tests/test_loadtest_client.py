"""The client's stream parsing, and that a run accounts for requests no server answers.

The load tester against a real Serve instance is tests/test_loadtest_serve.py; here no server
runs at all: the target port is closed, so every request must come back as a failed record.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from loadtest.arrivals import ClosedLoop, OpenLoop
from loadtest.client import RequestOptions, build_payload, parse_sse_line
from loadtest.runner import run_load
from loadtest.workload import WorkloadRequest


def test_parse_completion_chat_usage_error_and_done_lines():
    assert parse_sse_line('data: {"choices": [{"index": 0, "text": "Hi"}]}').text == "Hi"
    # The response's id lines a request up with the server's timelines (deployments' request timelines).
    assert parse_sse_line('data: {"id": "cmpl-1", "choices": [{"text": "Hi"}]}').response_id == "cmpl-1"
    chat = parse_sse_line('data: {"choices": [{"delta": {"content": " there"}}]}')
    assert chat.text == " there"
    role_only = parse_sse_line('data: {"choices": [{"delta": {"role": "assistant"}}]}')
    assert role_only.text == ""  # no token yet: must not count as the first token
    usage = parse_sse_line('data: {"choices": [], "usage": {"completion_tokens": 7}}')
    assert usage.text == "" and usage.usage == {"completion_tokens": 7}
    error = parse_sse_line('data: {"error": {"message": "too long", "type": "invalid_request",'
                           ' "param": null, "code": 400}}')
    assert error.error == "invalid_request: too long"
    assert parse_sse_line("data: [DONE]").done
    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None


def test_payload_streams_with_usage_and_ignores_eos():
    request = WorkloadRequest(prompt="hello", prompt_len=1, output_len=17)
    payload = build_payload(request, RequestOptions(top_k=5), model="m", seed=3)
    assert payload["stream"] and payload["stream_options"] == {"include_usage": True}
    assert (payload["prompt"], payload["max_tokens"], payload["ignore_eos"]) == ("hello", 17, True)
    assert (payload["top_k"], payload["seed"]) == (5, 3)
    chat = build_payload(request, RequestOptions(endpoint="chat"), model="m", seed=0)
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "prompt" not in chat


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def _workload(n: int) -> list[WorkloadRequest]:
    return [WorkloadRequest(prompt=f"p{i}", prompt_len=1, output_len=8) for i in range(n)]


@pytest.mark.parametrize("arrivals", [OpenLoop(rate_rps=50.0), ClosedLoop(concurrency=3)])
def test_unanswered_requests_are_all_recorded_as_failed(arrivals):
    base_url = f"http://127.0.0.1:{_closed_port()}"
    result = asyncio.run(run_load(base_url, _workload(12), arrivals, warmup=_workload(2),
                                  options=RequestOptions(model="m"), timeout_s=5.0,
                                  progress=False))
    summary = result.summary()
    assert [r.index for r in result.records] == list(range(12))
    assert (summary.submitted, summary.failed, summary.completed) == (12, 12, 0)
    assert summary.warmup_requests == 2
    assert all("Connect" in r.error for r in result.records)
    assert result.spec_decode is None and summary.spec_decode_error is not None


@pytest.mark.parametrize("arrivals", [OpenLoop(rate_rps=200.0), ClosedLoop(concurrency=3)])
def test_each_measured_record_is_handed_to_on_record_as_it_ends(arrivals):
    # A soak writes each record as it ends (benchmarks/lane_soak.py); warm-up records are not measured.
    seen = []
    result = asyncio.run(run_load(f"http://127.0.0.1:{_closed_port()}", _workload(7), arrivals, warmup=_workload(2),
                                  options=RequestOptions(model="m"), timeout_s=5.0, progress=False,
                                  on_record=seen.append))
    assert sorted(seen, key=lambda r: r.index) == result.records and len(seen) == 7


def test_open_loop_submits_on_schedule_and_duration_bounds_submission_only():
    base_url = f"http://127.0.0.1:{_closed_port()}"
    result = asyncio.run(run_load(base_url, _workload(3), OpenLoop(rate_rps=20.0),
                                  duration_s=1.0, options=RequestOptions(model="m"),
                                  progress=False))
    starts = [r.start_s for r in result.records]
    # The workload is cycled for the whole second: about 20 submissions at 20 req/s.
    assert 8 <= len(starts) <= 35
    assert starts[0] < 0.05 and max(starts) < 1.0
    assert starts == sorted(starts)

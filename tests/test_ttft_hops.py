"""benchmarks/ttft_hops.py: a request's TTFT split into hops from the client's record and the
ingress's and decode lane's timeline events."""

import pytest

from benchmarks.ttft_hops import HOPS, hops_ms
from loadtest.records import RequestRecord


def _record(ttft_ms: float | None) -> RequestRecord:
    return RequestRecord(index=0, kind="normal", prompt_len=4, output_len=8, status="completed", start_s=0.0,
                         end_s=1.0, ttft_ms=ttft_ms, response_id="cmpl-1", sent_wall_s=100.0)


def test_hops_follow_the_request_and_add_up_to_the_clients_ttft():
    ingress = {"start_s": 100.004, "called_s": 100.005, "first_s": 100.050}
    decode = {"start_s": 100.008, "first_s": 100.045}
    hops = hops_ms(_record(ttft_ms=60.0), ingress, decode)
    assert len(hops) == len(HOPS)
    assert hops == pytest.approx([4.0, 1.0, 3.0, 37.0, 5.0, 10.0])
    assert sum(hops) == pytest.approx(60.0)


def test_a_request_without_a_first_token_has_no_hops():
    assert hops_ms(_record(ttft_ms=None), {"start_s": 0, "called_s": 0, "first_s": None}, {"start_s": 0,
                                                                                           "first_s": None}) is None

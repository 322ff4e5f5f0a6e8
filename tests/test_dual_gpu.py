"""The dual-GPU benchmark's own logic: the placement check, goodput and the decode stall of each
workload, mixed traffic's context, and that every placement config means what it says when Ray packs
it onto two GPUs (reading the timelines: tests/test_lane_timelines.py)."""

import time
from types import SimpleNamespace

import pytest
import ray

from benchmarks.dual_gpu import (PLACEMENTS, as_intended, fit_lengths, goodput_table, observed_gpus, parse_args,
                                 placement_args, replica_gpus, sweep_requests)
from benchmarks.lib.loads import decode_stall_ms
from loadtest.records import RequestRecord
from loadtest.workload import load_tokenizer
from tests.timeline_helpers import lane_report


def test_observed_gpus_against_what_the_config_means():
    b = PLACEMENTS["b"]
    right = [lane_report("prefill", "p", "g0"), lane_report("decode", "d1", "g0"),
             lane_report("decode", "d2", "g0"), lane_report("verify", "v", "g1")]
    observed = observed_gpus(right, [{"index": 0, "uuid": "g0"}, {"index": 1, "uuid": "g1"}])
    assert observed["gpu_groups"] == [["decode", "decode", "prefill"], ["verify"]]
    assert [r["gpu_index"] for r in observed["replicas"]] == [0, 0, 0, 1]
    assert as_intended(b, observed)
    wrong = right[:2] + [lane_report("decode", "d2", "g1"), right[3]]
    assert not as_intended(b, observed_gpus(wrong, []))
    assert as_intended(b, observed_gpus([lane_report("verify", "v")], [])) is None  # CPU: nothing to check


@ray.remote(num_cpus=0)
class _Holder:
    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()


@pytest.mark.parametrize("key", sorted(PLACEMENTS))
def test_ray_packs_each_placement_as_its_config_means(two_fake_gpus, key):
    """Ray gives fractional GPU requests the GPU they fit most tightly and whole ones a free GPU:
    the placement holds in whatever order the replicas start (here: as listed, and reversed)."""
    spec = PLACEMENTS[key]
    asked = replica_gpus(placement_args(spec, "models/vpd-target", "models/vpd-draft", "cuda"))
    for order in (asked, asked[::-1]):
        holders, reports = [], []
        for n, (lane, num_gpus) in enumerate(order):
            holder = _Holder.options(num_gpus=num_gpus).remote()
            gpu_ids = ray.get(holder.gpu_ids.remote())  # placed before the next replica asks
            holders.append(holder)
            reports.append(lane_report(lane, str(n), uuid=f"gpu-{gpu_ids[0]}"))
        assert as_intended(spec, observed_gpus(reports, [])), (order, observed_gpus(reports, [])["gpu_groups"])
        for holder in holders:
            ray.kill(holder)
        deadline = time.monotonic() + 30
        while ray.available_resources().get("GPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # the next order starts from two free GPUs


def _point(workload: str, rate: float, rps: float, tpot_p99: float, ttft_p99: float, failed: int = 0,
           stall: float = 50.0) -> dict:
    def stats(p99: float) -> dict:
        return {"count": 10, "mean": p99, "p50": p99, "p95": p99, "p99": p99}

    return {"workload": workload, "rate_rps": rate, "saturated": False, "row": {"stall_ms p99": stall},
            "summary": {"submitted": 10, "completed": 10 - failed, "failed": failed, "timed_out": 0,
                        "request_throughput_rps": rps,
                        "latency_ms": {"tpot_ms": stats(tpot_p99), "ttft_ms": stats(ttft_p99)}}}


def test_goodput_is_the_fastest_rate_within_each_bound_with_every_request_completed():
    sweep = [_point("uniform", 4, 3.9, 12, 200, stall=40), _point("uniform", 8, 7.8, 18, 400, stall=60),
             _point("uniform", 16, 15.1, 25, 900, failed=1), _point("uniform", 32, 20.0, 29, 1500),
             _point("mixed", 4, 3.8, 31, 300)]
    rows = goodput_table({"placements": [{"key": "c", "sweep": sweep}]})
    uniform, mixed = rows
    assert (uniform["placement"], uniform["workload"]) == ("c", "uniform")
    # 16/s lost a request and 32/s passed the TTFT bound: neither counts at any TPOT bound.
    assert [uniform[f"goodput rps, TPOT<={b}"] for b in (15, 20, 30)] == [3.9, 7.8, 7.8]
    assert [uniform[f"stall ms p99, TPOT<={b}"] for b in (15, 20, 30)] == [40, 60, 60]
    assert (uniform["submitted"], uniform["completed"], uniform["failed"]) == (40, 39, 1)
    assert mixed["goodput rps, TPOT<=30"] is None  # no rate met even the widest bound


def test_the_decode_stall_is_over_short_requests_only():
    def record(kind: str, gaps: list[float], status: str = "completed") -> RequestRecord:
        return RequestRecord(0, kind, 16, 8, status, 0.0, 1.0, itl_ms=gaps)

    records = [record("normal", [5, 40, 5]), record("normal", [5, 10]), record("long", [900]),
               record("normal", [2000], status="failed")]
    point = SimpleNamespace(result=SimpleNamespace(records=records))
    assert decode_stall_ms(point, 100) == 40 and decode_stall_ms(point, 0) == 10


def test_mixed_traffic_gets_a_context_that_holds_its_long_prompts(tmp_path):
    args = parse_args(["--out", str(tmp_path), "--device", "cuda", "--placements", "d,b,c,f",
                       "--workloads", "uniform,mixed"])
    configs = {k: placement_args(PLACEMENTS[k], "models/vpd-target", "models/vpd-draft", "cuda") for k in args.placements}
    fit_lengths(args, configs)
    assert {c["engine"]["max_model_len"] for c in configs.values()} == {3000 + 128 + 64}
    requests = sweep_requests(args, load_tokenizer("models/vpd-target"), "mixed", 4.0)
    assert len(requests) == 20 and sum(r.kind == "long" for r in requests) == 2
    assert {r.output_len for r in requests} == {128}
    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path), "--workloads", "bursty"])

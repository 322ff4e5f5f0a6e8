"""The pieces of the benchmarks' harness (benchmarks/lib/) that must be right before a device call: the
saved pair and its tokenizer, rates taken from earlier points, and the time a load is expected to take."""

import subprocess
import sys
import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from benchmarks.lib.loads import Load, estimate_s
from benchmarks.lib.pairs import check_stored_head, save_pair, word_tokenizer
from benchmarks.lib.proc_cpu import CpuMeter, _role
from benchmarks.stream_latency import apply_overrides, parse_settings
from loadtest.arrivals import ClosedLoop, OpenLoop
from loadtest.summary import LatencyStats, Summary
from loadtest.workload import WorkloadRequest, random_prompt, usable_token_ids

def test_word_tokenizer_counts_words_as_tokens_and_has_no_special_ids(tmp_path):
    word_tokenizer(32000).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 32000 and tokenizer.all_special_ids == [] and tokenizer.eos_token_id is None
    ids = usable_token_ids(tokenizer)
    assert len(ids) == 32000
    for n in (1, 17, 900):
        text = random_prompt(tokenizer, ids, n, np.random.default_rng(n))
        encoded = tokenizer.encode(text, add_special_tokens=False)
        assert len(encoded) == n and tokenizer.decode(encoded) == text


def test_saved_small_pair_reloads_with_its_map_and_untied_heads(tmp_path):
    pair = save_pair("small", 0.8, tmp_path, dtype="float32", device="cpu", reload_check="full")
    check = pair.check
    assert check["ok"], check
    assert check["map_fidelity"] == {"target": 1.0, "draft": 1.0}
    assert abs(check["predicted_per_token_acceptance"]["greedy"] - 0.8) <= 0.05
    assert check_stored_head(pair.target)["ok"] and check_stored_head(pair.draft)["ok"]
    # A second agreement reuses the saved target (the target does not depend on it).
    mtime = [p.stat().st_mtime_ns for p in pair.target.glob("*.safetensors")]
    other = save_pair("small", 0.5, tmp_path, dtype="float32", device="cpu", reload_check="structure")
    assert other.target == pair.target and other.draft != pair.draft
    assert [p.stat().st_mtime_ns for p in pair.target.glob("*.safetensors")] == mtime


def test_rates_come_from_an_earlier_point_or_the_load_is_skipped():
    class Done:
        request_throughput_rps = 8.0

    load = Load("rate_high", [], rate_of="c64", factor=4.0)
    assert load.resolve({"c64": Done()}) == OpenLoop(32.0)
    assert load.resolve({}) is None
    assert Load("c1", [], ClosedLoop(1)).resolve({}) == ClosedLoop(1)


def _summary(tok_s: float, in_flight: float, e2e_p50_ms: float) -> Summary:
    stats = LatencyStats(count=1, mean=e2e_p50_ms, p50=e2e_p50_ms, p95=e2e_p50_ms, p99=e2e_p50_ms)
    return Summary(submitted=1, completed=1, failed=0, timed_out=0, warmup_requests=0, wall_s=1.0,
                   request_throughput_rps=1.0, output_token_throughput_tps=tok_s, total_token_throughput_tps=tok_s,
                   goodput_rps=None, mean_in_flight=in_flight, max_in_flight=int(in_flight), slos={},
                   latency_ms={"e2e_ms": stats}, latency_ms_by_kind={}, spec_decode=None, spec_decode_error=None)


def test_time_estimates_take_warmup_throughput_only_while_nothing_else_ran():
    """nospec at agreement 0.5 on an H200: the warm-up (graph capture) ran at 263 tok/s with 124 in
    flight, c64 at 1,472; taking the warm-up as the reference for a 192-request Poisson load said
    94 s, and the load was skipped with 37 s left."""
    requests = [WorkloadRequest("p", 16, 128)] * 192
    load = Load("rate_high", requests, rate_of="c64", factor=4.0)
    arrivals = OpenLoop(4 * 11.5)
    warmup, c64 = _summary(263.0, 123.5, 12_000.0), _summary(1472.0, 56.0, 5_000.0)
    assert estimate_s(load, arrivals, {"warmup": warmup}, frozenset({"warmup"})) == pytest.approx(192 * 128 / 263.0)
    estimate = estimate_s(load, arrivals, {"warmup": warmup, "c64": c64}, frozenset({"warmup"}))
    assert estimate == pytest.approx(192 * 128 / 1472.0)  # 16.7 s: it fits
    assert estimate_s(load, arrivals, {"warmup": warmup, "c64": c64}) > 90  # the old reference


def test_a_closed_loop_above_every_measured_concurrency_is_not_priced_at_single_stream_speed():
    """nospec at agreement 0.8 on an H200: c1 ran at 73 tok/s; unscaled, c64's 128 requests were
    priced at 221 s and skipped with 57 s left (the other modes ran c64 in 7-13 s)."""
    requests = [WorkloadRequest("p", 16, 128)] * 128
    load = Load("c64", requests, ClosedLoop(64))
    c1 = _summary(73.0, 1.0, 2_000.0)
    assert estimate_s(load, load.arrivals, {"c1": c1}) == pytest.approx(128 * 128 / (73.0 * 8))  # 28 s
    c64 = _summary(1472.0, 56.0, 5_000.0)
    assert estimate_s(load, load.arrivals, {"c1": c1, "c64": c64}) == pytest.approx(128 * 128 / (1472.0 * (64 / 56) ** 0.5))


def test_the_cpu_meter_sees_a_busy_process_use_a_core_and_an_idle_one_none():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # both past their start-up
        meter = CpuMeter({"busy": busy.pid, "idle": idle.pid, "gone": 2**22 + 7}).start()
        time.sleep(1.5)
        cores = meter.stop()
    finally:
        busy.kill()
        idle.kill()
    assert cores["busy"] > 0.5 and cores["idle"] < 0.1, cores  # a loaded 2-core host still gives it half
    assert "gone" not in cores


def test_serve_process_titles_name_the_role_also_while_a_call_runs():
    assert _role("ray::ServeReplica:nospec-x:Ingress", "nospec-x") == "Ingress"
    assert _role("ray::ServeReplica:nospec-x:DecodeLane.handle_request_streaming", "nospec-x") == "DecodeLane"
    assert _role("ray::ServeReplica:other:DecodeLane", "nospec-x") is None
    assert _role("ray::ProxyActor", "nospec-x") == "proxy"


def test_a_stream_setting_overrides_engine_keys_app_config_keys_and_dotted_paths():
    config = {"engine": {"max_num_seqs": 8}, "ingress": {"num_cpus": 0.1}}
    (_, interval_ms, rate, overrides), = parse_settings(
        'wide:0:0:ingress.num_replicas=4:cuda_graphs=false:stream_channel="step"')
    apply_overrides(config, overrides)
    assert (interval_ms, rate) == (0.0, None)
    assert config == {"engine": {"max_num_seqs": 8, "cuda_graphs": False},
                      "ingress": {"num_cpus": 0.1, "num_replicas": 4}, "stream_channel": "step"}

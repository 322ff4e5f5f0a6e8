"""The pieces of benchmarks/gpu_modes.py and its harness (benchmarks/lib/) that must be right before
a device call: the saved pair and its tokenizer, the memory plan, and rates taken from earlier points."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from benchmarks.gpu_modes import AgreementResults, fit_lengths, goals, parse_args
from benchmarks.lib.apps import AppRun
from benchmarks.lib.loads import Load, estimate_s
from benchmarks.lib.pairs import check_stored_head, save_pair, word_tokenizer
from loadtest.arrivals import ClosedLoop, OpenLoop
from loadtest.report import Point
from loadtest.summary import LatencyStats, Summary
from loadtest.workload import WorkloadRequest, random_prompt, usable_token_ids

H200_MIB, H100_MIB = 143771, 81559


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


def test_memory_plan_sizes_the_context_to_the_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (H200_MIB * 2**20, H200_MIB * 2**20))
    args = parse_args(["--out", str(tmp_path)])
    plan = fit_lengths(args)
    # pd / pdv: both models twice (~29 GiB) + 170 slots of (max_model_len + 64) tokens at 534 KiB each.
    assert args.max_model_len == plan["max_model_len"] == 1024
    assert args.long_prompt_len == 1024 - args.max_output_len
    assert 2 * plan["weights_gib_per_copy"] + plan["pools_gib"] + plan["reserve_gib"] <= plan["gpu_gib"]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (H100_MIB * 2**20, H100_MIB * 2**20))
    with pytest.raises(SystemExit, match="lower --max-num-seqs"):
        fit_lengths(parse_args(["--out", str(tmp_path)]))


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


def test_a_mode_that_lost_requests_is_not_the_best_lane_mode(tmp_path):
    """Agreement 0.5 on an H200: pd ran out of GPU memory on 1 of its 128 requests at c64."""
    def run(mode: str, tok_s: float, failed: int) -> AppRun:
        summary = replace(_summary(tok_s, 56.0, 5_000.0), submitted=128, completed=128 - failed, failed=failed)
        point = Point(mode, SimpleNamespace(records=[None] * 128), summary)
        return AppRun(mode, points=[(Load("c64", [], ClosedLoop(64)), point)])

    runs = {m: run(m, t, f) for m, t, f in [("nospec", 1663.0, 0), ("spec", 1916.0, 0), ("pd", 2408.0, 1),
                                             ("pdv", 2115.0, 0)]}
    at_64 = goals(AgreementResults(SimpleNamespace(agreement=0.5), runs=runs),
                  parse_args(["--out", str(tmp_path)]))["at_64_in_flight"]
    assert at_64["best_lane_mode"] == "pdv" and at_64["failed_or_timed_out_by_mode"] == {
        "nospec": 0, "spec": 0, "pd": 1, "pdv": 0}
    assert at_64["best_over_spec"] == round(2115 / 1916, 3) and at_64["by_mode_tok_s"]["pd"] == 2408.0

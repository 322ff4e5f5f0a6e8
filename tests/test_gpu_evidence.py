"""The pure pieces of issue 31's GPU scripts (benchmarks/gpu_evidence.py, paged_capacity.py, families_fused.py):
the contiguous baseline's arithmetic, the workloads built from token ids, the checks against the goals. No Ray,
no model: the device runs are what measure."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.constructed_pair import successor_maps
from benchmarks.families_fused import floor_ms, kv_bytes
from benchmarks.gpu_evidence import (GRAMMAR_TOKENS, RESERVED_IDS, Pair, app_config, chain, controller_checks,
                                     controller_loads, copy_requests, extras_checks, grammar_tokenizer,
                                     prefix_checks, shared_prefix_requests)
from benchmarks.lib.apps import beside
from benchmarks.lib.results import ratio, verdict
from benchmarks.lib.loads import in_flight_steps
from benchmarks.paged_capacity import checks as paged_checks
from benchmarks.paged_capacity import contiguous_slots, lognormal_lengths, slot_capacity
from lanes.engine.core import EngineConfig
from loadtest.records import RequestRecord


def test_contiguous_slots_are_whole_slots_of_max_model_len_plus_slack():
    capacity = slot_capacity(32768, max_draft_len=8)
    assert capacity == EngineConfig(max_model_len=32768, max_draft_len=8).slot_capacity_tokens > 32768
    assert contiguous_slots(10 * capacity - 1, capacity) == 9
    assert contiguous_slots(10 * capacity, capacity) == 10
    assert contiguous_slots(capacity - 1, capacity) == 0


def test_lognormal_prompts_stay_in_bounds_and_vary_tenfold():
    lengths = lognormal_lengths(2000, seed=3)
    assert min(lengths) >= 64 and max(lengths) <= 4096
    assert np.percentile(lengths, 95) / np.percentile(lengths, 5) >= 10


def test_paged_checks_divide_by_the_baseline():
    doc = {"capacity": {"peak_running": 240, "contiguous_slots": 5},
           "throughput": {"paged": {"output_tok_s": 3000.0}, "contiguous": {"output_tok_s": 2000.0}}}
    rows = {r["goal"][:3]: r for r in paged_checks(doc)}
    assert rows["(a)"]["ratio"] == 48.0 and rows["(a)"]["verdict"] == "met"
    assert rows["(b)"]["ratio"] == 1.5 and rows["(b)"]["verdict"] == "MISSED"


def test_copy_workload_ends_where_the_target_repeats_the_document():
    successor = successor_maps(32000, 0.8, seed=0)[0].numpy()
    (request,) = copy_requests(successor, 1, doc_len=50, output_len=20, seed=1)
    ids = [int(w[1:]) for w in request.prompt.split()]
    doc = ids[:50]
    assert doc == chain(successor, doc[0], 50)
    assert ids[-1] == doc[0] and request.prompt_len == 50 + 8 + 1
    # The target's greedy output after the last prompt token is the document again, from its second token.
    assert chain(successor, ids[-1], 21)[1:] == doc[1:21]
    assert min(ids) >= RESERVED_IDS


def test_shared_prefix_requests_share_exactly_the_prefix():
    requests = shared_prefix_requests(32000, 3, prefix_len=20, suffix_len=4, output_len=2, seed=0)
    prompts = [r.prompt.split() for r in requests]
    assert all(len(p) == 24 for p in prompts)
    assert prompts[0][:20] == prompts[1][:20] == prompts[2][:20]
    assert len({tuple(p[20:]) for p in prompts}) == 3


def test_grammar_tokenizer_names_the_reserved_ids_and_reads_prompts_by_word():
    tokenizer = grammar_tokenizer(64)
    assert tokenizer.convert_ids_to_tokens(list(range(len(GRAMMAR_TOKENS)))) == GRAMMAR_TOKENS
    assert tokenizer.eos_token_id == 0
    assert tokenizer.encode("t20 t63", add_special_tokens=False) == [20, 63]


def _record(start_s: float, end_s: float) -> RequestRecord:
    return RequestRecord(0, "normal", 1, 1, "completed", start_s, end_s)


def test_in_flight_steps_follow_submits_and_ends():
    steps = in_flight_steps([_record(0.0, 2.0), _record(1.0, 3.0)], origin_s=10.0)
    assert [count for _, count in steps] == [1, 2, 1, 0]
    assert steps[0][0] == 10.0 and steps[-1][0] == 13.0


def _report(rows: list[tuple[str, str, float, float | None]]) -> SimpleNamespace:
    return SimpleNamespace(doc={"rows": [{"app": a, "load": l, "tok_s": t, "ttft_ms p50": t, "acceptance": acc}
                                         for a, l, t, acc in rows]})


def test_controller_checks_apply_the_stricter_goal_at_low_load():
    report = _report([("nospec", "c1", 100.0, None), ("spec", "c1", 125.0, 0.7),
                      ("nospec", "c64", 1000.0, None), ("spec", "c64", 980.0, 0.7)])
    checks = {(c["mode"], c["load"]): c for c in controller_checks(report, ["spec"], ["c1", "c64", "poisson"])}
    assert checks[("spec", "c1")]["verdict"] == "MISSED"  # 1.25 < 1.3
    assert checks[("spec", "c64")]["verdict"] == "met"  # 0.98 >= 0.97
    assert checks[("spec", "poisson")]["verdict"] == "not measured"


def test_extras_are_measured_against_both_plain_points():
    report = _report([("extras", "plain", 1000.0, 0.7), ("extras", "plain_again", 800.0, 0.7),
                      ("extras", "logprobs", 810.0, 0.7), ("extras", "json_schema", 700.0, 0.6)])
    checks = {c["load"]: c for c in extras_checks(report)}
    assert checks["logprobs"]["x_plain"] == 0.9 and checks["logprobs"]["verdict"] == "met"
    assert checks["json_schema"]["x_plain"] == pytest.approx(0.778) and checks["json_schema"]["verdict"] == "MISSED"
    assert checks["penalties"]["verdict"] == "not measured"


def test_prefix_check_is_ttft_off_over_on():
    report = _report([("unified-cache-off", "shared", 300.0, None), ("unified-cache-on", "shared", 60.0, None)])
    (check,) = prefix_checks(report, ["unified"])
    assert check["off / on"] == 5.0 and check["verdict"] == "met"


def test_ratio_and_verdict_edges():
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None
    assert verdict(1.05, ("<=", 1.05)) == "met" and verdict(0.969, (">=", 0.97)) == "MISSED"


def test_floor_counts_weights_and_every_layer_kv():
    config = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=32)
    assert kv_bytes(config, batch=3, context=10, itemsize=2) == 2 * 2 * 2 * 32 * 2 * 3 * 10
    # 1 GB of weights and no KV read at 1,000 GB/s: 1 ms.
    assert floor_ms(10**9, config, batch=1, context=0, itemsize=2, bandwidth_gbs=1000.0) == pytest.approx(1.0)


def test_a_sampler_runs_beside_its_load_and_stops_with_it():
    samples = []

    async def sampler():
        while True:
            samples.append(len(samples))
            await asyncio.sleep(0.01)

    async def load():
        await asyncio.sleep(0.05)
        return "done"

    async def run():
        result = await beside(load(), sampler())
        seen = len(samples)
        await asyncio.sleep(0.05)
        return result, seen

    assert asyncio.run(run()) == ("done", len(samples)) and len(samples) >= 2


def test_controller_part_merges_its_flag_into_the_drafting_modes_block():
    args = SimpleNamespace(part="controller", controller='{"min_draft_len": 2}', dtype="float32", lane_num_cpus=0.25,
                           max_model_len=128, max_num_seqs=8, device="cpu")
    pair = Pair(Path("/tmp/target"), Path("/tmp/draft"), 64, np.arange(64))
    block = app_config("unified", pair, args)["controller"]
    assert block["enabled"] and block["initial_draft_len"] == 3 and block["min_draft_len"] == 2
    assert not app_config("nospec", pair, args).get("controller", {}).get("enabled")
    args.part = "ngram"
    assert app_config("unified", pair, args, ngram=True)["draft"] == {"method": "ngram"}


def test_each_controller_point_follows_an_unmeasured_one_at_its_concurrency():
    """The L a point shows is the one the controller settles on at that load: an unmeasured closed loop of
    the same concurrency runs first, on requests of its own (the measured ones' prompts stay out of the
    prefix cache)."""
    args = SimpleNamespace(max_num_seqs=8, single_requests=2, requests_per_slot=2, min_measured_requests=12,
                           settle_requests_per_slot=3)
    requests = list(range(2 * 8 + 8 + 3 * 8))  # as part_controller draws them: measured, warm-up, settling
    loads = controller_loads(requests, [1, 4, 8], args, {"rate_of": "c8", "factor": 0.9})
    assert [(load.name, load.measured) for load in loads] == [
        ("warmup", False), ("settle c1", False), ("c1", True), ("settle c4", False), ("c4", True),
        ("settle c8", False), ("c8", True), ("poisson", True)]
    by_name = {load.name: load for load in loads}
    # 2 x C a point, at least min_measured_requests past C = 1
    assert [len(by_name[name].requests) for name in ("c1", "c4", "c8")] == [2, 12, 16]
    assert by_name["settle c1"].arrivals.concurrency == 1 and by_name["settle c8"].arrivals.concurrency == 8
    assert len(by_name["settle c1"].requests) == 6 and len(by_name["settle c8"].requests) == 24
    measured = {r for load in loads if load.measured for r in load.requests}
    assert not measured & set(by_name["settle c8"].requests)

"""The pure pieces of the GPU scripts (benchmarks/gpu_evidence.py, gpu_check.py): the workloads built from
token ids, the checks against the goals, the bandwidth floor, and the in-process reference's closed loops on the
shipped pair. No Ray: the device runs are what measure."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.gpu_check import floor_ms, kv_bytes
from benchmarks.gpu_evidence import (app_config, controller_checks, controller_loads, prefix_checks,
                                     shared_prefix_requests)
from benchmarks.lib.apps import beside
from benchmarks.lib.results import ratio, verdict


def test_shared_prefix_requests_share_exactly_the_prefix():
    requests = shared_prefix_requests(32000, 3, prefix_len=20, suffix_len=4, output_len=2, seed=0)
    prompts = [r.prompt.split() for r in requests]
    assert all(len(p) == 24 for p in prompts)
    assert prompts[0][:20] == prompts[1][:20] == prompts[2][:20]
    assert len({tuple(p[20:]) for p in prompts}) == 3


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
    model = torch.nn.Linear(1000, 500, bias=False).to(torch.bfloat16)
    model.config = SimpleNamespace(to_dict=lambda: config)
    # 1 MB of weights and no KV read at 1 GB/s: 1 ms; at context 10 the KV of one row adds 2 x 2 x 2 x 32 x 2 x 10 B.
    assert floor_ms(model, batch=1, context=0, bandwidth_gbs=1.0) == pytest.approx(1.0)
    assert floor_ms(model, batch=1, context=10, bandwidth_gbs=1.0) == pytest.approx(1.0 + 5120 / 1e6)


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
                           max_model_len=128, max_num_seqs=8, device="cpu", engine={"async_scheduling": True},
                           draft={"quantization": "int8"})
    pair = SimpleNamespace(target=Path("/tmp/target"), draft=Path("/tmp/draft"))
    block = app_config("unified", pair, args)["controller"]
    # --draft reaches the drafting modes' draft block, over the pair's path
    draft = app_config("pdv", pair, args)["draft"]
    assert draft["quantization"] == "int8" and draft["path"] == "/tmp/draft"
    assert block["enabled"] and block["initial_draft_len"] == 3 and block["min_draft_len"] == 2
    for mode in ("nospec", "unified", "pdv"):  # --engine reaches every mode's engine, over the part's own sizes
        engine = app_config(mode, pair, args, engine={"max_num_seqs": 4, "async_scheduling": False})["engine"]
        assert engine["async_scheduling"] is True and engine["max_num_seqs"] == 4 and engine["max_model_len"] == 128
    assert not app_config("nospec", pair, args).get("controller", {}).get("enabled")
    args.part = "prefix"
    assert not app_config("unified", pair, args).get("controller", {}).get("enabled")


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


def test_the_in_process_engine_runs_the_closed_loops_it_is_given_and_counts_every_request():
    """The served app's engine without Serve (benchmarks/lib/in_process.py): built from the app's config as its
    replica builds it, the settling loops unmeasured, every measured request completed with all its tokens."""
    from benchmarks.lib.in_process import EngineLoad, measure
    from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET
    from tests.serve_helpers import app_config as served_config

    config = served_config("spec", DEFAULT_TARGET, DEFAULT_DRAFT)
    prompts = [f"def f{i}(x):" for i in range(6)]
    result = measure(config, [EngineLoad("settle c2", prompts[4:], 8, 2, measured=False),
                              EngineLoad("c1", prompts[:1], 8, 1), EngineLoad("c2", prompts[:4], 8, 2)])
    assert [r["load"] for r in result["rows"]] == ["c1", "c2"] and result["draft_len"] == 3
    for row in result["rows"]:
        assert row["completed"] == row["submitted"] and row["failed"] == 0, row
        assert row["tok_s"] > 0 and row["ttft_ms p50"] > 0 and row["tpot_ms p50"] > 0, row
    with pytest.raises(ValueError, match="pdv"):
        measure(served_config("pdv", DEFAULT_TARGET, DEFAULT_DRAFT), [])


def test_served_rows_stand_beside_their_in_process_ones_and_nospec_must_keep_09():
    from benchmarks.gpu_evidence import engine_loads, in_process_checks, served_over_in_process

    args = SimpleNamespace(max_num_seqs=8, single_requests=2, requests_per_slot=2, min_measured_requests=4,
                           settle_requests_per_slot=1)
    requests = [SimpleNamespace(prompt=f"t{i}", output_len=4) for i in range(2 * 8 + 8 + 8)]
    loads = engine_loads(controller_loads(requests, [1, 8], args, {"rate_of": "c8"}))
    assert [(load.name, load.concurrency, load.measured) for load in loads] == [
        ("settle c1", 1, False), ("c1", 1, True), ("settle c8", 8, False), ("c8", 8, True)]  # no warm-up, no Poisson
    assert loads[1].prompts == ["t0", "t1"] and loads[1].output_len == 4
    report = _report([("nospec", "c1", 90.0, None), ("nospec", "c8", 85.0, None), ("spec", "c1", 150.0, 0.7)])
    engine = {"nospec": {"draft_len": 0, "rows": [{"load": load, "tok_s": 100.0, "ttft_ms p50": 5.0,
                                                    "tpot_ms p50": 1.0, "completed": 2, "submitted": 2}
                                                   for load in ("c1", "c8")]}}
    rows = served_over_in_process(report, engine)
    assert [(r["load"], r["served / in process"], r["ttft_ms p50 served"]) for r in rows] == [("c1", 0.9, 90.0),
                                                                                          ("c8", 0.85, 85.0)]
    assert [c["verdict"] for c in in_process_checks(rows)] == ["met", "MISSED"]


def test_a_request_the_engine_drops_without_a_last_output_counts_as_failed():
    from benchmarks.lib.in_process import EngineLoad, closed_loop
    from lanes.engine.outputs import RequestOutput

    class Dropping:  # ends "x-1" as asked and forgets "x-0" without a last output (unguarded, the loop would wait forever)
        def __init__(self):
            self.ids = []

        def add_request(self, request_id, prompt, params):
            self.ids.append(request_id)

        def step(self):
            return [RequestOutput(i, [7, 7], "", finished=True, finish_reason="length") for i in self.ids
                    if i.endswith("1")]

        @property
        def has_work(self):
            return False

    row = closed_loop(Dropping(), EngineLoad("x", ["a", "b"], 2, 2))
    assert (row["submitted"], row["completed"], row["failed"]) == (2, 1, 1)

"""A torch.profiler trace of an engine's next steps (lanes/engine/step_trace.py): whole steps, by region,
written where asked, the output unchanged; and the same through an engine process's call."""

import asyncio
import gzip
import json
from functools import partial

import pytest

from lanes.engine import step_trace
from lanes.engine.process import ProcessEngine
from lanes.engine.step_trace import StepTrace, busy_us, start_trace, trace_summary
from lanes.sample.params import SamplingParams
from tests.conftest import VOCAB
from tests.engine_helpers import pair_engine, random_prompts, run_to_completion, small_engine

DECODE_REGIONS = {"admit", "take_in", "make_room", "draft", "verify_launch", "prefill", "verify_wait", "rollback",
                  "append"}


def _requests(count: int = 4, max_tokens: int = 24) -> dict:
    prompts = random_prompts(count, VOCAB, 3, 20, seed=5)
    return {f"r{i}": (p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i, p in enumerate(prompts)}


def test_a_trace_records_whole_steps_by_region_and_leaves_the_output_unchanged(llama_pair, tmp_path):
    target, draft = llama_pair
    expected = run_to_completion(small_engine(target, draft), _requests())
    engine = small_engine(target, draft)
    for request_id, (prompt, params) in _requests().items():
        engine.add_request(request_id, prompt, params)
    outputs = {request_id: [] for request_id in expected}
    for _ in range(2):  # requests decoding when the trace starts
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
    start_trace(engine, 3, str(tmp_path), "engine")
    with pytest.raises(RuntimeError, match="already recording"):
        start_trace(engine, 3, str(tmp_path), "again")
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
    assert outputs == expected

    summary = trace_summary(engine)
    assert summary["steps"] == 3 and summary["name"] == "engine"
    regions = summary["region_ms_per_step"]
    assert DECODE_REGIONS <= set(regions)
    # Regions nest in the step, and the window holds each step whole.
    assert 0 < max(regions.values()) <= summary["window_ms_per_step"]
    assert summary["outside_regions_ms_per_step"] >= 0
    assert summary["top_host_ops_self_ms_per_step"]  # the draft model's ops
    assert summary["device_busy_ms_per_step"] == summary["kernel_ms_per_step"] == 0  # no device on CPU
    assert json.loads((tmp_path / "engine.summary.json").read_text()) == summary
    with gzip.open(tmp_path / "engine.trace.json.gz") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"vpd.draft", "vpd.verify_wait"} <= names
    assert step_trace.region("draft") is step_trace._NO_REGION  # nothing records once the trace is written


def test_a_trace_whose_engine_goes_idle_ends_on_request_with_the_steps_it_saw(llama_pair, tmp_path):
    target, draft = llama_pair
    engine = small_engine(target, draft)
    with pytest.raises(RuntimeError, match="no trace"):
        trace_summary(engine)
    start_trace(engine, 1000, str(tmp_path), "idle")
    run_to_completion(engine, _requests(count=2, max_tokens=6))
    assert trace_summary(engine) is None  # still recording: fewer steps than asked
    summary = trace_summary(engine, stop=True)
    assert 0 < summary["steps"] < 1000 and (tmp_path / "idle.trace.json.gz").exists()
    assert trace_summary(engine, stop=True) is summary
    start_trace(engine, 2, str(tmp_path), "next")  # a finished trace does not block the next


def test_a_trace_that_never_saw_a_step_writes_nothing(tmp_path):
    trace = StepTrace(5, tmp_path, "never")
    assert trace.finish() == {"name": "never", "steps": 0} and not list(tmp_path.iterdir())
    with pytest.raises(ValueError):
        StepTrace(0, tmp_path, "none")


def test_a_profiler_that_fails_ends_the_trace_with_its_error_and_the_engine_steps_on(llama_pair, tmp_path,
                                                                                    monkeypatch):
    class Broken:
        def __init__(self, **_):
            pass

        def start(self):
            raise RuntimeError("CUPTI is not available")

        def stop(self):
            pass

    monkeypatch.setattr(step_trace, "profile", Broken)
    target, draft = llama_pair
    expected = run_to_completion(small_engine(target, draft), _requests(count=2, max_tokens=8))
    engine = small_engine(target, draft)
    start_trace(engine, 3, str(tmp_path), "broken")
    assert run_to_completion(engine, _requests(count=2, max_tokens=8)) == expected
    assert trace_summary(engine) == {"name": "broken", "steps": 0, "error": "RuntimeError: CUPTI is not available"}
    assert step_trace.region("draft") is step_trace._NO_REGION and not list(tmp_path.iterdir())


def test_busy_time_is_the_union_of_the_kernels_intervals():
    assert busy_us([]) == 0
    assert busy_us([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_an_engine_process_is_traced_through_its_call_with_the_loops_own_work(tmp_path):
    """Through ProcessEngine.call, as `EngineServer.trace` does: the engine process records its steps and the
    loop's sending of each step's outputs to the replica between them."""
    prompts = random_prompts(4, VOCAB, 3, 20, seed=9)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main():
        engine = ProcessEngine(partial(pair_engine, "llama"))
        try:
            await engine.call(partial(start_trace, num_steps=4, out_dir=str(tmp_path), name="process"))
            await asyncio.gather(*(_drain(engine.generate(p, params)) for p in prompts))
            while (summary := await engine.call(trace_summary)) is None:
                await asyncio.sleep(0.05)
            return summary
        finally:
            engine.shutdown()

    summary = asyncio.run(main())
    assert summary["steps"] == 4
    assert {"draft", "verify_wait", "send_outputs"} <= set(summary["region_ms_per_step"])
    assert (tmp_path / "process.trace.json.gz").exists()

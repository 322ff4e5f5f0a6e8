"""A served app's engine in a process of its own, without Serve: the reference a served figure stands beside.

In the one-deployment modes (nospec, spec, unified) the decode lane's engine is `deployments.factories.build_engine`
of the app's config. Here the same config builds the same engine, in a spawned process (the driver then holds no
GPU memory while the served app runs), and `EngineCore.step()` in a loop drives it: a closed loop of C requests,
the next added as soon as one ends, with the prompts and lengths the served point sends. No Ray, no asyncio,
no proxy, no draft-length controller: L stays at the config's `num_speculative_tokens`.

TTFT here runs from `add_request` to the step that returns the request's first token; TPOT from that step to
its last, over the tokens after the first, and tok/s over the loop's first arrival to its last end: the
load tester's own records and summary (loadtest/), on the engine's clock.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

from deployments.config import AppConfig
from deployments.factories import build_engine
from lanes.sample.params import SamplingParams
from loadtest.records import RequestRecord
from loadtest.summary import Summary, summarize

ENGINE_MODES = ("nospec", "spec", "unified")  # the modes whose whole engine runs in one process


@dataclass(frozen=True)
class EngineLoad:
    """One closed loop: `prompts` (text, tokenized by the engine as the ingress would), `concurrency` at once."""

    name: str
    prompts: list[str]
    output_len: int
    concurrency: int
    measured: bool = True


def closed_loop(engine, load: EngineLoad) -> dict:
    """Run `load` on `engine` (an EngineCore); every request a RequestRecord, completed (all its tokens) or
    failed, summarized as the load tester summarizes a served point (loadtest/summary.py)."""
    params = SamplingParams(max_tokens=load.output_len, temperature=0.0, ignore_eos=True)
    waiting = list(enumerate(load.prompts))[::-1]
    running: dict[str, dict] = {}
    records: list[RequestRecord] = []
    began_s = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < load.concurrency:
            index, prompt = waiting.pop()
            request_id = f"{load.name}-{index}"
            running[request_id] = {"index": index, "added_s": time.perf_counter(), "first_s": None, "tokens": 0}
            engine.add_request(request_id, prompt, params)
        outputs = engine.step()
        now_s = time.perf_counter()
        for out in outputs:
            request = running.get(out.request_id)
            if request is None:
                continue
            if out.token_ids and request["first_s"] is None:
                request["first_s"] = now_s
            request["tokens"] += len(out.token_ids)
            if out.finished:
                del running[out.request_id]
                ok = out.finish_reason == "length" and request["tokens"] == load.output_len
                records.append(_record(request, load.output_len, began_s, now_s, ok))
        if running and not engine.has_work:  # dropped without a last output: failed, not waited for forever
            records += [_record(request, load.output_len, began_s, now_s, False) for request in running.values()]
            running.clear()
    s = summarize(records)
    return {"load": load.name, "submitted": s.submitted, "completed": s.completed, "failed": s.failed,
            "tok_s": round(s.output_token_throughput_tps, 1), "ttft_ms p50": _p50(s, "ttft_ms"),
            "tpot_ms p50": _p50(s, "tpot_ms"), "wall_s": round(s.wall_s, 2)}


def _record(request: dict, output_len: int, began_s: float, now_s: float, ok: bool) -> RequestRecord:
    """A request that ended at `now_s`: completed with all its tokens (`ok`), or failed."""
    first_s, tokens = request["first_s"], request["tokens"]
    ttft_ms = None if first_s is None else 1e3 * (first_s - request["added_s"])
    tpot_ms = 1e3 * (now_s - first_s) / (tokens - 1) if ok and tokens > 1 else None
    return RequestRecord(request["index"], "normal", 0, output_len, "completed" if ok else "failed",
                         request["added_s"] - began_s, now_s - began_s, ttft_ms=ttft_ms, tpot_ms=tpot_ms,
                         completion_tokens=tokens, error=None if ok else "ended without all its tokens")


def _p50(summary: Summary, metric: str) -> float | None:
    value = summary.latency_ms[metric].p50
    return None if value is None else round(value, 2)


def measure(config: dict, loads: list[EngineLoad]) -> dict:
    """Build the decode lane's engine of `config` (an app's args) as its replica does, then run `loads` in
    order; the measured ones' rows, and the seconds the build took (weights, graphs, cost probe)."""
    cfg = AppConfig.model_validate(config)
    if cfg.mode not in ENGINE_MODES:
        raise ValueError(f"mode {cfg.mode!r} has no engine in one process; in process: {ENGINE_MODES}")
    began_s = time.perf_counter()
    engine = build_engine(cfg, None)
    build_s = time.perf_counter() - began_s
    rows = [row for load in loads if (row := closed_loop(engine, load)) and load.measured]
    return {"build_s": round(build_s, 1), "rows": rows, "draft_len": engine.default_draft_len}


def measure_apart(config: dict, loads: list[EngineLoad]) -> dict:
    """`measure` in a spawned process, which gives back every byte of device memory as it exits."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(measure, config, loads).result()

"""A served app's engine in a process of its own, without Serve: the reference a served figure stands beside.

In the one-deployment modes (nospec, spec, unified) the decode lane's engine is `deployments.factories.build_engine`
of the app's config. Here the same config builds the same engine, in a spawned process (the driver then holds no
GPU memory while the served app runs), and `EngineCore.step()` in a loop drives it: a closed loop of C requests,
the next added as soon as one ends, with the prompts and lengths the served point sends. No Ray, no asyncio,
no proxy, no draft-length controller: L stays at the config's `num_speculative_tokens`.

TTFT here runs from `add_request` to the step that returns the request's first token; TPOT from that step to
its last, over the tokens after the first (loadtest/records.py's definitions, on the engine's clock).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

from deployments.config import AppConfig
from deployments.factories import build_engine
from lanes.sample.params import SamplingParams

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
    """Run `load` on `engine` (an EngineCore); every request counted: completed (all its tokens) or failed."""
    params = SamplingParams(max_tokens=load.output_len, temperature=0.0, ignore_eos=True)
    waiting = [(f"{load.name}-{i}", prompt) for i, prompt in enumerate(load.prompts)][::-1]
    running: dict[str, dict] = {}
    ended: list[dict] = []
    began_s = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < load.concurrency:
            request_id, prompt = waiting.pop()
            running[request_id] = {"added_s": time.perf_counter(), "first_s": None, "tokens": 0}
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
                request.update(end_s=now_s, ok=out.finish_reason == "length" and request["tokens"] == load.output_len)
                ended.append(running.pop(out.request_id))
        if running and not engine.has_work:  # dropped without a last output: failed, not waited for forever
            ended += [dict(r, ok=False) for r in running.values()]
            running.clear()
    wall_s = time.perf_counter() - began_s
    done = [r for r in ended if r["ok"]]
    ttft_ms = [1e3 * (r["first_s"] - r["added_s"]) for r in done]
    tpot_ms = [1e3 * (r["end_s"] - r["first_s"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    return {"load": load.name, "submitted": len(load.prompts), "completed": len(done),
            "failed": len(ended) - len(done), "tok_s": round(sum(r["tokens"] for r in done) / wall_s, 1),
            "ttft_ms p50": _median(ttft_ms), "tpot_ms p50": _median(tpot_ms), "wall_s": round(wall_s, 2)}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


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

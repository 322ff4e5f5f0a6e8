"""The engine in process, no Ray or asyncio: the co-located engine of an app config and a closed loop over
`EngineCore.step()` (benchmarks/paged_capacity.py; the in-process reference of served runs)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from benchmarks.lib.cluster import free_device_memory, log
from deployments.config import AppConfig
from deployments.factories import build_proposer
from lanes.engine.core import EngineCore
from lanes.engine.step_profile import STALL_STEP_MS
from lanes.model.loader import load_model
from lanes.sample.params import SamplingParams
from loadtest.records import RequestRecord
from loadtest.workload import WorkloadRequest


@dataclass(frozen=True)
class Work:
    """Token-id prompts, so no tokenizer is in the way; greedy, ignore_eos."""

    prompts: list[list[int]]
    output_len: int
    concurrency: int
    vocab_size: int

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.output_len, temperature=0.0, ignore_eos=True)

    def workload(self) -> list[WorkloadRequest]:
        return [WorkloadRequest(p, len(p), self.output_len) for p in self.prompts]  # type: ignore[arg-type]


def random_work(vocab_size: int, prompt_len: int, output_len: int, concurrency: int, count: int, seed: int) -> Work:
    rng = np.random.default_rng(seed)
    return Work(rng.integers(1, vocab_size, (count, prompt_len)).tolist(), output_len, concurrency, vocab_size)


def run_engine(core: EngineCore, work: Work) -> tuple[list[RequestRecord], dict]:
    """Closed loop over EngineCore.step(): C requests in flight, each finished one replaced at once."""
    params = work.params()
    pending = list(enumerate(work.prompts))
    live: dict[str, tuple[int, float, list[float | None]]] = {}  # id -> (index, start, [ttft])
    records: list[RequestRecord] = []
    step_s: list[float] = []
    origin = time.perf_counter()

    def admit() -> None:
        while pending and len(live) < work.concurrency:
            index, prompt = pending.pop(0)
            rid = uuid.uuid4().hex
            core.add_request(rid, prompt, params)
            live[rid] = (index, time.perf_counter() - origin, [None])

    profile_before = replace(core.step_profile)
    stalls, captured = [], graph_captures(core)
    admit()
    while live:
        start, rows = time.perf_counter(), len(core.scheduler.running)
        prefill_tokens = core.scheduler.num_prefill_tokens
        outputs = core.step()
        now = time.perf_counter()
        step_s.append(now - start)
        if now - start >= STALL_STEP_MS / 1e3:  # say what the stall was: a capture, or something else
            new = {k: round(v) for k, v in graph_captures(core).items() if k not in captured}
            captured.update(new)
            stalls.append({"step": len(step_s) - 1, "ms": round((now - start) * 1e3), "rows": rows,
                           "prefill_tokens": core.scheduler.num_prefill_tokens - prefill_tokens, "captured_ms": new})
        for out in outputs:
            index, start_s, first = live[out.request_id]
            if out.token_ids and first[0] is None:
                first[0] = now - origin
            if out.finished:
                del live[out.request_id]
                records.append(_record(index, work, start_s, now - origin, first[0], out.num_output_tokens,
                                       "completed" if out.error is None else "failed", out.error))
        admit()
    return records, {"steps": len(step_s), "step_ms_mean": 1e3 * float(np.mean(step_s)),
                     "profile": core.step_profile.since(profile_before).summary(), "stalls": stalls}


def graph_captures(core: EngineCore) -> dict[str, float]:
    """Every CUDA graph the engine's runners captured so far, with what its capture cost (ms)."""
    found = {}
    for name, runner in core.local_runners().items():
        for kind in ("graphs", "prefill_graphs"):
            if (graphs := getattr(runner, kind, None)) is not None:
                found.update({f"{name} {kind} {key}": ms for key, ms in graphs.capture_ms.items()})
    return found


def _record(index: int, work: Work, start_s: float, end_s: float, first_s: float | None, tokens: int,
            status: str, error: str | None = None) -> RequestRecord:
    ttft_ms = None if first_s is None else (first_s - start_s) * 1e3
    tpot_ms = (end_s - first_s) * 1e3 / (tokens - 1) if first_s is not None and tokens > 1 else None
    return RequestRecord(index, "normal", len(work.prompts[index]), work.output_len, status, start_s, end_s,
                         ttft_ms, tpot_ms, [], tokens, error=error)


@contextlib.contextmanager
def colocated_engine(cfg: AppConfig, device: str, capture: bool = True) -> Iterator[EngineCore]:
    """The co-located engine of the mode's config (unified's lanes for pd and pdv), its graphs
    captured as a served engine's are at start (deployments/factories.py); freed on exit."""
    target = load_model(cfg.target.path, cfg.target.dtype, device)
    draft = load_model(spec.path, spec.dtype, device) if (spec := cfg.draft_model) is not None else None
    mode = cfg.mode if cfg.mode in ("nospec", "spec", "unified") else "unified"
    core = EngineCore.colocated(target, draft, cfg.engine.engine_config(mode), proposer=build_proposer(cfg, device))
    try:
        if capture:
            log(f"{cfg.mode}: graphs captured in {core.capture_graphs() / 1e3:.1f} s")
        yield core
    finally:
        del core, target, draft
        free_device_memory()

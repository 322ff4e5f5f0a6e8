"""What serving costs: the same requests in process and served, for every mode, in one run (issue 14).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serving_overhead.py --device cpu --out /tmp/so
    python3 benchmarks/serving_overhead.py --device cuda --shape tinyllama-7b --agreement 0.8 --out OUT

Each mode's closed loop (C requests in flight, random token-id prompts, greedy, ignore_eos) runs
three ways, one after another on the same machine (the same request shapes; each way draws its own
prompts, so that none reads another's prefix cache):

    engine   the lanes code without Ray or asyncio: EngineCore.step() in a loop in this process,
             a new request added as soon as one finishes (the engine's own speed). pd and pdv have
             no Ray-free form; their reference is this engine with their engine config (the
             co-located lanes: prefill, draft and verify in one process).
    handle   the mode deployed on Ray Serve, driven through a DeploymentHandle to its DecodeLane
             (engine replica + Ray's streaming hand-off; no ingress, no proxy)
    http     the same app through Serve's HTTP proxy and the OpenAI ingress, with the load
             tester's streaming client (what users see)

It reports served / engine for throughput and TPOT, and where the served time goes: the engine
step (mean step time served against in process: how much the replica's serving work slows the
step loop), the output hand-off (handle against engine), and ingress + proxy (http against
handle); with the stream messages a decode replica sent per engine step.

Writes serving_overhead_<device>.json and .md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import ray
from ray import serve
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.apps import GPU_SHARES, MAX_ONGOING  # noqa: E402
from benchmarks.lib.cluster import (ALL_MODES, benchmark_app_args, deploy, free_device_memory,  # noqa: E402
                                    git_commit, load_average, log, machine, start_cluster)
from benchmarks.lib.pairs import save_pair  # noqa: E402
from benchmarks.ttft_hops import hops_table, ttft_hops  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from deployments.factories import build_proposer  # noqa: E402
from lanes.engine.core import EngineCore  # noqa: E402
from lanes.engine.step_profile import STALL_STEP_MS, StepProfile  # noqa: E402
from lanes.model.loader import load_model  # noqa: E402
from lanes.sample.params import SamplingParams  # noqa: E402
from loadtest.arrivals import ClosedLoop  # noqa: E402
from loadtest.records import RequestRecord  # noqa: E402
from loadtest.runner import run_load  # noqa: E402
from loadtest.summary import Summary, summarize  # noqa: E402
from loadtest.workload import WorkloadRequest  # noqa: E402

WAYS = ("engine", "handle", "http")


@dataclass(frozen=True)
class Work:
    """The requests every way of every mode gets: token-id prompts, so no tokenizer is in the way."""

    prompts: list[list[int]]
    output_len: int
    concurrency: int
    vocab_size: int

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.output_len, temperature=0.0, ignore_eos=True)

    def workload(self) -> list[WorkloadRequest]:
        return [WorkloadRequest(p, len(p), self.output_len) for p in self.prompts]  # type: ignore[arg-type]


def random_work(vocab_size: int, args: argparse.Namespace, count: int, seed: int) -> Work:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, vocab_size, (count, args.prompt_len)).tolist()
    return Work(prompts, args.output_len, args.concurrency, vocab_size)


def reseeded(work: Work, seed: int) -> list[list[int]]:
    """Prompts of the same count and lengths as `work`'s, drawn anew (no prefix shared with them)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, work.vocab_size, len(p)).tolist() for p in work.prompts]


# ---- engine: no Ray, no asyncio ----------------------------------------------------------------

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


def engine_point(cfg: AppConfig, work: Work, warmup: Work, device: str, runs: int = 1) -> dict:
    """The co-located engine of the mode's config, warmed up first. With `runs` > 1 the work runs
    again on the same engine and the last run counts; the others are kept under "earlier_runs", so a
    first run that paid for captures shows itself."""
    with colocated_engine(cfg, device) as core:
        run_engine(core, warmup)
        earlier = []
        for run in range(runs):
            # Earlier runs get prompts of their own: repeated prompts would hit the prefix cache.
            fresh = work if run == runs - 1 else replace(work, prompts=reseeded(work, 100 + run))
            records, steps = run_engine(core, fresh)
            point = {"summary": summarize(records), "steps": steps, "spec": core.total_stats.to_dict()}
            log(f"in process, run {run + 1}/{runs}: {point['summary'].output_token_throughput_tps:.1f} tok/s, "
                f"{json.dumps(steps)}")
            earlier.append(point)
        point["earlier_runs"] = [{"output_tok_s": p["summary"].output_token_throughput_tps, "steps": p["steps"]}
                                 for p in earlier[:-1]]
        return point


# ---- served ------------------------------------------------------------------------------------

async def _handle_request(handle, index: int, prompt: list[int], work: Work, origin: float) -> RequestRecord:
    start_s, first_s, tokens = time.perf_counter() - origin, None, 0
    try:
        async for out in handle.options(stream=True).generate.remote(prompt, work.params(), uuid.uuid4().hex):
            if getattr(out, "token_ids", None) and first_s is None:
                first_s = time.perf_counter() - origin
            tokens = getattr(out, "num_output_tokens", tokens)
            if getattr(out, "error", None) or not hasattr(out, "token_ids"):
                return _record(index, work, start_s, time.perf_counter() - origin, first_s, tokens, "failed",
                               str(getattr(out, "error", None) or getattr(out, "message", out)))
    except Exception as exc:  # a failed replica call is a result, not a crash
        return _record(index, work, start_s, time.perf_counter() - origin, first_s, tokens, "failed", repr(exc))
    return _record(index, work, start_s, time.perf_counter() - origin, first_s, tokens, "completed")


async def run_handle(handle, work: Work) -> list[RequestRecord]:
    pending = list(enumerate(work.prompts))
    records: list[RequestRecord] = []
    origin = time.perf_counter()

    async def worker() -> None:
        while pending:
            index, prompt = pending.pop(0)
            records.append(await _handle_request(handle, index, prompt, work, origin))

    await asyncio.gather(*(worker() for _ in range(work.concurrency)))
    return records


def replica_counters(handle) -> dict:
    """Steps, time in steps and stream messages of the app's one DecodeLane replica, cumulative."""
    stats = handle.stats.remote().result()
    return {**{k: stats[k] for k in ("num_steps", "step_ms_total", "num_messages", "pid")},
            "profile": StepProfile(**stats["step_profile"])}


def start_profile(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    """py-spy's sampled stacks of the process that steps the engine (the engine process, or the replica
    where the engine is a thread; every thread, by name), if py-spy is here."""
    if seconds <= 0 or shutil.which("py-spy") is None:
        return None
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "250",
                             "--threads", "--nonblocking", "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def served_points(name: str, port: int, work: Work, warmup: Work, timeout_s: float,
                  profile_s: float = 0, profile_out: Path | None = None) -> dict:
    handle = serve.get_deployment_handle("DecodeLane", app_name=name)
    points = {}
    asyncio.run(run_handle(handle, warmup))
    for way in ("handle", "http"):
        before = replica_counters(handle)
        profiler = start_profile(before["pid"], profile_s, profile_out) if way == "http" else None
        if way == "handle":
            records = asyncio.run(run_handle(handle, work))
            summary = summarize(records)
        else:
            # Prompts drawn anew: the handle way's are still in the replica's prefix cache.
            fresh = replace(work, prompts=reseeded(work, 2))
            start_s = time.time()
            result = asyncio.run(run_load(f"http://127.0.0.1:{port}/{name}", fresh.workload(),
                                          ClosedLoop(work.concurrency), options=_options(), timeout_s=timeout_s,
                                          progress=False))
            summary = result.summary()
            points["ttft_hops"] = ttft_hops(name, result.records, start_s)
        after = replica_counters(handle)
        if profiler is not None:
            profiler.wait(timeout=60)
        steps, step_ms, messages = (after[k] - before[k] for k in ("num_steps", "step_ms_total", "num_messages"))
        points[way] = {"summary": summary,
                       "steps": {"steps": steps, "step_ms_mean": step_ms / steps if steps else None,
                                 "messages": messages, "messages_per_step": messages / steps if steps else None,
                                 "profile": after["profile"].since(before["profile"]).summary()}}
    return points


def _options():
    from loadtest.client import RequestOptions
    return RequestOptions(endpoint="completions", temperature=0.0, ignore_eos=True)


# ---- the run -----------------------------------------------------------------------------------

def app_config(mode: str, target: Path | None, draft: Path | None, args: argparse.Namespace) -> dict:
    engine = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.prompt_len + args.output_len + 64,
              "num_speculative_tokens": args.draft_len, "max_draft_len": max(args.draft_len, 8)}
    if args.prefill_chunk_tokens is not None:
        engine["prefill_chunk_tokens"] = args.prefill_chunk_tokens
    config = benchmark_app_args(mode, target, draft, dtype=args.dtype, engine=engine,
                                lane_num_cpus=args.lane_num_cpus, max_ongoing=MAX_ONGOING,
                                gpu_shares=GPU_SHARES[mode] if args.device == "cuda" else None)
    if args.stream_interval_ms is not None:
        config["stream_interval_ms"] = args.stream_interval_ms
    return config


def point_row(mode: str, way: str, point: dict, engine: dict) -> dict:
    s: Summary = point["summary"]
    ref: Summary = engine["summary"]
    tpot, ref_tpot = s.latency_ms["tpot_ms"].p50, ref.latency_ms["tpot_ms"].p50
    return {
        "mode": mode, "way": way, "submitted": s.submitted, "completed": s.completed, "failed": s.failed,
        "timed_out": s.timed_out, "output_tok_s": round(s.output_token_throughput_tps, 1),
        "x_engine_throughput": round(s.output_token_throughput_tps / ref.output_token_throughput_tps, 3),
        "tpot_p50_ms": _r(tpot), "tpot_p95_ms": _r(s.latency_ms["tpot_ms"].p95),
        "x_engine_tpot_p50": _r(tpot / ref_tpot if tpot and ref_tpot else None, 3),
        "ttft_p50_ms": _r(s.latency_ms["ttft_ms"].p50),
        "step_ms_mean": _r(point["steps"].get("step_ms_mean")),
        "messages_per_step": _r(point["steps"].get("messages_per_step")),
    }


def _r(value, digits: int = 2):
    return None if value is None else round(value, digits)


def markdown(doc: dict) -> str:
    rows = doc["rows"]
    cols = list(rows[0]) if rows else []
    lines = [f"# Serving overhead ({doc['machine'].get('gpu') or doc['machine']['cpu_model']})", "",
             f"`{doc['command']}` (commit {doc['commit']}); {doc['work']}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |" for r in rows]
    lines += ["", "## Where served time goes (TPOT p50, ms)", "",
              "| mode | engine | + output hand-off (handle) | + ingress and proxy (http) | step served / in process |",
              "|---|---|---|---|---|"]
    for mode, b in doc["breakdown"].items():
        lines.append(f"| {mode} | {b['engine_tpot_ms']} | {b['handoff_ms']} | {b['ingress_proxy_ms']} | "
                     f"{b['step_ratio']} |")
    lines += [""] + hops_table(doc.get("ttft_hops", {}))
    lines += ["## Engine steps by what they launched", "",
              "Counted by the engine itself (lanes/engine/step_profile.py): the share of steps that launched a prefill "
              "forward, the prompt tokens each ran, running requests per step, and the mean time of each kind of step.",
              "", "| mode | way | steps | prefill steps share | prefill tokens per prefill step | rows mean | "
              "decode-only step ms | prefill step ms | stall steps (>= 200 ms) | stall ms |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc.get("step_profiles", []):
        lines.append("| " + " | ".join("" if v is None else str(_r(v, 3) if isinstance(v, float) else v)
                                      for v in r.values()) + " |")
    if doc.get("errors"):
        lines += ["", "## Failures", ""] + [f"- {m}: {e}" for m, e in doc["errors"].items()]
    return "\n".join(lines) + "\n"


def write(doc: dict, stem: Path) -> None:
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(doc))


def breakdown(points: dict) -> dict:
    e, h, w = (points[k]["summary"].latency_ms["tpot_ms"].p50 for k in WAYS)
    step_e, step_w = points["engine"]["steps"]["step_ms_mean"], points["http"]["steps"].get("step_ms_mean")
    return {"engine_tpot_ms": _r(e), "handoff_ms": _r(h - e if h and e else None),
            "ingress_proxy_ms": _r(w - h if w and h else None),
            "step_ratio": _r(step_w / step_e if step_w and step_e else None, 3)}


def variants(args: argparse.Namespace) -> list[tuple[float | None, bool]]:
    """(max_stream_messages_per_s or None for the config's, engine on a replica thread?) per served run."""
    return [(rate, way == "thread") for way in args.engine_ways for rate in args.max_stream_rates or [None]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", default="tinyllama-7b", help="cuda: the constructed pair's shape")
    parser.add_argument("--agreement", type=float, default=0.8, help="cuda: the constructed pair's agreement")
    parser.add_argument("--pair-dir", type=Path, default=Path("/tmp/vpd_gpu_modes"))
    parser.add_argument("--modes", default=",".join(ALL_MODES))
    parser.add_argument("--concurrency", type=int, default=None, help="default 64 on cuda, 8 on cpu")
    parser.add_argument("--requests", type=int, default=None, help="default 256 on cuda, 32 on cpu")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 on cuda, 64 on cpu")
    parser.add_argument("--output-len", type=int, default=None, help="default 128 on cuda, 64 on cpu")
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--stream-interval-ms", type=float, default=None, help="default: the app config's")
    parser.add_argument("--max-stream-rates", type=lambda t: [float(x) for x in t.split(",")], default=None,
                        help="serve each mode once per max_stream_messages_per_s in this list (0: no bound); "
                        "default: once, with the app config's default")
    parser.add_argument("--engine-ways", type=lambda t: t.split(","), default=["process"],
                        help="process (engine_process: true, the default for unified, spec and nospec), thread "
                        "(the engine on a thread of the replica), or both: process,thread")
    parser.add_argument("--profile-s", type=float, default=0,
                        help="sample the process that steps the engine with py-spy for this long during the http run")
    parser.add_argument("--engine-runs", type=int, default=1,
                        help="run the work this many times in process on one engine; the last run counts")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None,
                        help="engine.prefill_chunk_tokens (default: the app config's)")
    parser.add_argument("--engine-only", action="store_true", help="measure in process only; serve nothing")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    for key, gpu, cpu in (("concurrency", 64, 8), ("requests", 256, 32), ("prompt_len", 128, 64),
                          ("output_len", 128, 64)):
        if getattr(args, key) is None:
            setattr(args, key, gpu if cuda else cpu)
    args.dtype = "bfloat16" if cuda else "float32"
    args.max_num_seqs = max(args.concurrency, 8)
    args.lane_num_cpus = 1.0 if cuda else 0.25
    args.modes = args.modes.split(",")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = args.device
    target = draft = None
    if device == "cuda":
        pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=args.dtype, device=device)
        target, draft = pair.target, pair.draft
    probe = AppConfig.model_validate(app_config("nospec", target, draft, args))
    vocab = AutoConfig.from_pretrained(probe.target.path).get_text_config().vocab_size
    work = random_work(vocab, args, args.requests, seed=0)
    # Warm-up: CUDA graphs are captured per batch bucket on first use; short outputs pass every
    # bucket on the way down as the closed loop drains.
    warmup = replace(random_work(vocab, args, args.concurrency * 2, seed=1), output_len=min(32, args.output_len))
    doc = {"command": "python benchmarks/serving_overhead.py " + " ".join(argv), "commit": git_commit(),
           "machine": machine(), "load_average_before": load_average(),
           "work": f"{args.requests} requests, {args.concurrency} in flight (closed loop), prompts of "
                   f"{args.prompt_len} random tokens, {args.output_len} output tokens, greedy, ignore_eos, "
                   f"L = {args.draft_len}, {args.dtype}",
           "rows": [], "breakdown": {}, "ttft_hops": {}, "step_profiles": [], "spec": {}, "errors": {},
           "earlier_engine_runs": {}}
    port = start_cluster({"TRITON_INTERPRET": "0"} if device == "cuda" else None)
    try:
        for mode in args.modes:
            log(f"{mode}: in process")
            engine = engine_point(AppConfig.model_validate(app_config(mode, target, draft, args)), work, warmup,
                                  device, args.engine_runs)
            doc["earlier_engine_runs"][mode] = engine["earlier_runs"]
            if args.engine_only:
                doc["rows"].append(point_row(mode, "engine", engine, engine))
                doc["step_profiles"].append({"mode": mode, "way": "engine", **engine["steps"]["profile"]})
                write(doc, args.out / f"serving_overhead_{device}")
                continue
            for rate, thread in variants(args):
                config = app_config(mode, target, draft, args)
                config["engine_process"] = not thread
                if rate is not None:
                    config["max_stream_messages_per_s"] = rate or None  # 0: no bound
                label = mode + ("" if rate is None else f"@{rate:g}/s") + ("+thread" if thread else "")
                name = "so-" + label.replace("@", "-r").replace("/s", "").replace("+", "-")
                try:
                    log(f"{label}: deploying")
                    deploy(name, config, timeout_s=600)
                    points = {"engine": engine, **served_points(name, port, work, warmup, args.request_timeout_s,
                                                                args.profile_s, args.out / f"pyspy_{name}.txt")}
                except Exception as exc:  # one mode failing leaves the others measured
                    doc["errors"][label] = repr(exc)
                    log(f"{label}: failed: {exc!r}")
                    continue
                finally:
                    serve.delete(name)
                    free_device_memory()
                doc["rows"] += [point_row(label, way, points[way], engine) for way in WAYS]
                doc["breakdown"][label] = breakdown(points)
                doc["ttft_hops"][label] = points["ttft_hops"]
                doc["step_profiles"] += [{"mode": label, "way": way, **points[way]["steps"]["profile"]} for way in WAYS]
                doc["spec"][label] = {"engine": engine["spec"], "http": (asdict(points["http"]["summary"].spec_decode)
                                                                          if points["http"]["summary"].spec_decode
                                                                          else None)}
                for row in doc["rows"][-3:]:
                    log(json.dumps(row))
                write(doc, args.out / f"serving_overhead_{device}")
    finally:
        serve.shutdown()
        ray.shutdown()
    log("done")


if __name__ == "__main__":
    os.environ.setdefault("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT", "1")
    main()

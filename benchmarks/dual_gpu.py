"""Lanes placed over the two GPUs of one host, against one GPU and against data parallelism
(method and results in docs/dual_gpu.md).

Placements, each one file of configs/placements/ deployed as it is (only the model paths are
replaced by the pair this run saves, and the context raised where mixed traffic needs it):

    a   unified-1gpu        the co-located engine on one GPU (the one-GPU reference)
    a2  pdv-1gpu            the three lanes on one GPU (KV by CUDA IPC)
    b   pdv-verify-apart    prefill + 2 decode replicas on one GPU, verify alone on the other
    c   pdv-prefill-apart   prefill alone on one GPU, 2 decode replicas + verify on the other
    d   unified-dp2         two co-located engines, one per GPU (data parallel)
    f   pd-prefill-apart    prefill alone on one GPU, one decode replica (draft + verify) on the other

Per placement, in one Ray cluster, one placement at a time (the harness of benchmarks/lib/): deploy
and record which GPU every replica got (checked against what the config means); warm up (a burst
that passes every CUDA-graph batch bucket, with two long prompts when mixed traffic follows); for
each of --workloads, a Poisson rate sweep with the load tester (rates doubling until p95 TTFT shows
queueing or a request fails, then one rate between the last two), every request accounted for,
acceptance measured from each response's spec-decode counters:
    uniform   prompts and outputs of log-normal lengths (lib/apps.py's PRESETS)
    mixed     10 % of prompts 3,000 tokens, the rest 128; 128 out (lib/loads.py's MIXED)
From the lanes' timelines (deployments/telemetry/timeline.py), how long the verify lane ran while a decode
replica was drafting; in pdv placements the cost of each KV hand-over against prompt length (one
request at a time; --no-handover leaves it out). Ends with a device-to-device copy between the two
GPUs of the same sizes, as a reference for what the hand-over could cost over NVLink.

Per placement and workload it reports goodput (the most completed requests/s among the rates with
every request completed, p99 TTFT <= 1 s and p99 TPOT within 15, 20 and 30 ms) and the p99 decode
stall at that rate (a short request's longest gap between two stream chunks), and per point the
requests completed, failed and timed out.

The whole run keeps to --budget-s: a placement that no longer fits is recorded as skipped, a
placement that fails is recorded with its error, a workload's rates stop when its share of the
placement's time runs out, and results are rewritten after every point.

    python3 benchmarks/dual_gpu.py --out DIR                       # two-H200 machine, under 9 minutes
    python3 benchmarks/dual_gpu.py --out DIR --placements d,b,c,f --workloads uniform,mixed \
        --rates 4,8,16,32 --sat-ttft-ms 1000 --no-handover --budget-s 520     # one device call
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dual_gpu.py --shape small --device cpu \
        --budget-s 1300 --out DIR                                  # CPU dry run: every step, no GPUs
    .venv/bin/python benchmarks/dual_gpu.py --plot-only DIR        # plots from DIR/dual_gpu.json

Writes DIR/dual_gpu.json (everything, every request), dual_gpu.md (tables), dual_gpu.csv (one
column per placement and rate) and, where matplotlib is installed, dual_gpu_load_curve.png,
dual_gpu_tpot_throughput.png, dual_gpu_goodput.png and dual_gpu_handover.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # replicas inherit it: kernels compile for the GPU

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from ray import serve  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.constructed_pair import shape_configs  # noqa: E402
from benchmarks.lib.timelines import prefill_path_table, timelines  # noqa: E402
from benchmarks.lib.apps import PRESETS, AppRun, deploy_app, lane_reader, last_point, run_loads  # noqa: E402
from benchmarks.lib.cluster import (REPO, git_commit, gpu_inventory, log, machine, shm_gib,  # noqa: E402
                                    start_model_cluster, topology, wait_for_device_memory)
from benchmarks.lib.loads import MIXED, Load, mixed_requests, warmup_requests  # noqa: E402
from benchmarks.lib.pairs import PAIR_DIR, parameter_count, save_pair  # noqa: E402
from benchmarks.lib.results import (TPOT_SLOS_MS, TTFT_SLO_MS, goodput, plot_bars, pyplot, request_rows,  # noqa: E402
                                    row, rows_table, summary_from_dict, write_document)
from deployments.config import AppConfig  # noqa: E402
from loadtest.arrivals import ClosedLoop, OpenLoop  # noqa: E402
from loadtest.report import Point, comparison_table, markdown_table, plot_load_curves  # noqa: E402
from loadtest.runner import RunResult, run_load  # noqa: E402
from loadtest.summary import Summary  # noqa: E402
from loadtest.workload import (LogNormal, WorkloadRequest, count_tokens, load_tokenizer,  # noqa: E402
                               random_prompt, synthetic, usable_token_ids)

NAME = "dual_gpu"
TPOT_BOUNDS_MS = (5, 7.5, 10, 15, 20, 30, 50, 100)  # p95 TPOT bounds of the throughput-at-latency table
REFERENCE = "a"  # the one-GPU placement the goal compares against
RESERVE_S = 20.0  # kept back from the budget for the last results and the reference copy
MIN_PLACEMENT_S = {"cuda": 75.0, "cpu": 60.0}  # less, and a placement cannot deploy, warm up and run two rates
DELETE_S = 10.0  # what removing an app takes, allowed for in every placement
HANDOVER_S = {"cuda": 20.0, "cpu": 30.0}  # the hand-over measurement, allowed for in pdv placements
WORKLOADS = ("uniform", "mixed")


@dataclass(frozen=True)
class PlacementSpec:
    key: str
    config: str  # file in configs/placements/
    title: str
    # Lanes of the replicas sharing each GPU (one tuple per GPU, sorted): what the config means.
    gpus: tuple[tuple[str, ...], ...]


PLACEMENTS = {p.key: p for p in (
    PlacementSpec("a", "a-unified-1gpu.yaml", "(a) unified, one GPU", (("engine",),)),
    PlacementSpec("a2", "a2-pdv-1gpu.yaml", "(a') pdv, one GPU", (("decode", "decode", "prefill", "verify"),)),
    PlacementSpec("b", "b-pdv-verify-apart.yaml", "(b) prefill + draft, verify apart",
                  (("decode", "decode", "prefill"), ("verify",))),
    PlacementSpec("c", "c-pdv-prefill-apart.yaml", "(c) prefill apart, draft + verify",
                  (("decode", "decode", "verify"), ("prefill",))),
    PlacementSpec("d", "d-unified-dp2.yaml", "(d) unified x2, data parallel", (("engine",), ("engine",))),
    PlacementSpec("f", "f-pd-prefill-apart.yaml", "(f) pd, prefill apart, draft + verify in one engine",
                  (("decode",), ("prefill",))),
)}


# ---- where replicas run ------------------------------------------------------------------------

def observed_gpus(reports: list[dict], inventory: list[dict]) -> dict:
    """Which GPU each replica got, grouped the way PlacementSpec.gpus states intent."""
    index = {g["uuid"]: g["index"] for g in inventory}
    replicas, groups = [], {}
    for r in reports:
        uuid = r["placement"]["gpu_uuid"]
        replicas.append({"lane": r["lane"], "replica": r["replica"], "gpu_uuid": uuid, "gpu_index": index.get(uuid),
                         "ray_gpu_ids": r["ray_gpu_ids"], "cuda_visible_devices": r["cuda_visible_devices"]})
        if uuid is not None:
            groups.setdefault(uuid, []).append(r["lane"])
    shared = sorted(tuple(sorted(lanes)) for lanes in groups.values())
    return {"replicas": replicas, "gpu_groups": [list(g) for g in shared]}


def as_intended(spec: PlacementSpec, observed: dict) -> bool | None:
    """True when the replicas share GPUs exactly as the config means; None without GPUs."""
    if not observed["gpu_groups"]:
        return None
    return [tuple(g) for g in observed["gpu_groups"]] == sorted(spec.gpus)


# ---- configs ---------------------------------------------------------------------------------

def placement_args(spec: PlacementSpec, target: str, draft: str, device: str) -> dict:
    """The `args:` of the placement's config with this run's pair; on the CPU, a dry-run version."""
    config = yaml.safe_load((REPO / "configs" / "placements" / spec.config).read_text())
    args = config["applications"][0]["args"]
    args["target"]["path"], args["draft"]["path"] = target, draft
    if device == "cpu":
        args = cpu_dry_run(args)
    AppConfig.model_validate(args)  # a config error names the field before anything starts
    return args


def cpu_dry_run(args: dict) -> dict:
    """The same graph (modes, replica counts) on CPU-sized engines: no GPUs, small pools, fp32."""
    args = json.loads(json.dumps(args))
    for lane in ("ingress", "prefill_lane", "decode_lane", "verify_lane"):
        if lane in args:
            args[lane] |= {"num_gpus": 0, "num_cpus": 0.1}
    args["engine"] |= {"max_model_len": 640, "max_num_seqs": 8, "prefill_chunk_tokens": 128}
    args["target"]["dtype"] = args["draft"]["dtype"] = "float32"
    return args


def replica_gpus(app_args: dict) -> list[tuple[str, float]]:
    """(lane, num_gpus) of every lane replica the config asks for, lanes named as replicas report them."""
    cfg = AppConfig.model_validate(app_args)
    names = {"prefill_lane": "prefill", "verify_lane": "verify",
             "decode_lane": "decode" if cfg.mode in ("pd", "pdv") else "engine"}
    return [(names[lane], getattr(cfg, lane).num_gpus) for lane in cfg.lanes
            for _ in range(getattr(cfg, lane).num_replicas or 1)]


def decode_slots(args: dict) -> int:
    cfg = AppConfig.model_validate(args)
    return cfg.engine.max_num_seqs * (cfg.decode_lane.num_replicas or 1)


# ---- workloads ---------------------------------------------------------------------------------

def sweep_requests(args: argparse.Namespace, tokenizer, workload: str, rate: float) -> list[WorkloadRequest]:
    """About `window_s` seconds of requests at `rate`, the same for every placement (seeded by the
    rate). uniform: log-normal lengths (PRESETS); mixed: MIXED's traffic."""
    count, seed = max(8, round(rate * args.window_s)), args.seed + round(rate * 100)
    if workload == "mixed":
        return mixed_requests(tokenizer, count, seed, args.device)
    return synthetic(tokenizer, count, seed, prompt_lengths(args),
                     LogNormal(args.output_len_median, 0.3, args.min_output_len, args.max_output_len))


def prompt_lengths(args: argparse.Namespace) -> LogNormal:
    return LogNormal(args.prompt_len_median, 0.6, args.min_prompt_len, args.max_prompt_len)


def fixed_length_requests(tokenizer, lengths: list[int], reps: int, seed: int) -> list[WorkloadRequest]:
    """For each length, reps + 1 prompts of exactly that many tokens (the first warms that shape)."""
    rng, usable = np.random.default_rng(seed), usable_token_ids(tokenizer)
    out = []
    for length in lengths:
        for _ in range(reps + 1):
            prompt = random_prompt(tokenizer, usable, length, rng)
            out.append(WorkloadRequest(prompt, count_tokens(tokenizer, prompt), 2))
    return out


# ---- one placement ----------------------------------------------------------------------------

def run_placement(spec: PlacementSpec, app_args: dict, args: argparse.Namespace, tokenizer, port: int,
                  deadline_s: float, inventory: list[dict], on_point: Callable[[dict], None]) -> dict:
    """Deploy, check where replicas run, warm up, sweep each workload, measure hand-overs; the app is
    removed after. `on_point(result)` after every point: the placement's results so far."""
    mode = app_args["mode"]
    result: dict = {"key": spec.key, "title": spec.title, "config": f"configs/placements/{spec.config}",
                    "app_args": app_args, "status": "running", "timings_s": {}, "sweep": []}
    run = AppRun(spec.key)

    def record(run: AppRun) -> None:
        result["sweep"] = sweep_points(run, args.sat_ttft_ms)
        on_point(result)

    phase_s = time.monotonic()
    if not deploy_app(run, app_args, timeout_s=max(30.0, deadline_s - time.monotonic() - DELETE_S)):
        return result | {"status": "failed", "error": run.error, "replica_logs": run.replica_logs}
    try:
        result["timings_s"]["deploy"] = round(time.monotonic() - phase_s, 1)
        observed = observed_gpus(timelines(spec.key, mode, time.time()), inventory)
        result |= {"placement": observed, "as_intended": as_intended(spec, observed),
                   "asked_num_gpus": replica_gpus(app_args)}
        log(f"{spec.key}: GPUs {observed['gpu_groups'] or 'none (CPU)'}, as intended: {result['as_intended']}")

        phase_s = time.monotonic()
        handover = mode == "pdv" and args.handover
        sweeps_end_s = deadline_s - DELETE_S - (HANDOVER_S[args.device] if handover else 0.0)
        options = dict(request_timeout_s=args.request_timeout_s, seed=args.seed, request_counters=True,
                       on_point=record, lanes_of=lane_reader(spec.key, mode))
        long_prompts = 2 if "mixed" in args.workloads else 0  # a placement meets long prompts first here
        warm = Load("warmup", warmup_requests(tokenizer, decode_slots(app_args), args.seed + 7, prompt_lengths(args),
                                              long_prompts, MIXED[args.device]["long"]),
                    OpenLoop(math.inf), measured=False)
        run_loads(run, port, [warm], sweeps_end_s, **options)
        warmed = last_point(run, warm)
        result["warmup"] = {"requests": len(warm.requests), "completed": warmed.summary.completed if warmed else 0}
        result["timings_s"]["warmup"] = round(time.monotonic() - phase_s, 1)

        phase_s = time.monotonic()
        for n, workload in enumerate(args.workloads):  # each workload an equal share of the time left
            share_s = (sweeps_end_s - time.monotonic()) / (len(args.workloads) - n)
            sweep(run, port, workload, args, tokenizer, time.monotonic() + share_s, options)
        result["timings_s"]["sweep"] = round(time.monotonic() - phase_s, 1)

        if handover:
            phase_s = time.monotonic()
            max_model_len = AppConfig.model_validate(app_args).engine.max_model_len
            try:
                result["handover"] = handover_costs(spec.key, f"http://127.0.0.1:{port}/{spec.key}", args, tokenizer,
                                                    max_model_len)
            except Exception as exc:  # noqa: BLE001 - the sweep's results stand without it
                result["handover_error"] = f"{type(exc).__name__}: {exc}"
            result["timings_s"]["handover"] = round(time.monotonic() - phase_s, 1)
            log(f"{spec.key}: hand-over in {result['timings_s']['handover']} s "
                f"{result.get('handover_error') or json.dumps(result['handover'])}")
    except Exception as exc:  # noqa: BLE001 - recorded; the next placement still runs
        run.failed(f"{type(exc).__name__}: {exc}")
    finally:
        phase_s = time.monotonic()
        try:
            serve.delete(spec.key)
        except Exception as exc:  # noqa: BLE001
            log(f"{spec.key}: delete failed: {exc}")
        result["timings_s"]["delete"] = round(time.monotonic() - phase_s, 1)
    result |= {"status": run.status, "sweep": sweep_points(run, args.sat_ttft_ms), "skipped_loads": run.skipped}
    return result | ({"error": run.error, "replica_logs": run.replica_logs} if run.error else {})


def sweep(run: AppRun, port: int, workload: str, args: argparse.Namespace, tokenizer, deadline_s: float,
          options: dict) -> None:
    """Poisson arrivals at each rate until one saturates or time runs out; after the first saturated
    rate, one rate between it and the last unsaturated one (the knee is where placements differ)."""
    rates, last_ok = list(args.rates), None
    while rates:
        rate = rates.pop(0)
        load = Load(f"{workload} {rate:g}/s", sweep_requests(args, tokenizer, workload, rate), OpenLoop(rate))
        run_loads(run, port, [load], deadline_s, **options)
        point = last_point(run, load)
        if point is None:  # no time left for it
            return
        if not saturated(point.summary, args.sat_ttft_ms):
            last_ok = rate
            continue
        between = round(math.sqrt(last_ok * rate), 2) if last_ok is not None else None
        rates = [between] if args.refine and between is not None and between not in args.rates + [rate] else []
        last_ok = None  # after the rate between, stop whatever it shows


def saturated(summary: Summary, sat_ttft_ms: float) -> bool:
    """A request failed or timed out, or p95 TTFT shows queueing."""
    ttft_p95 = summary.latency_ms["ttft_ms"].p95
    return summary.completed < summary.submitted or ttft_p95 is None or ttft_p95 > sat_ttft_ms


def sweep_points(run: AppRun, sat_ttft_ms: float) -> list[dict]:
    """The measured points as the results keep them, each with its row (counts, p99s, decode stall),
    by workload in run order, then by rate."""
    points = []
    for load, point in run.points:
        if load.measured:
            workload = load.name.split()[0]
            points.append({"workload": workload, "rate_rps": load.arrivals.rate_rps,
                           "summary": point.summary.to_dict(), "saturated": saturated(point.summary, sat_ttft_ms),
                           "lanes": run.lanes.get(load.name, {}),
                           "row": row(point, placement=run.name, workload=workload), "requests": request_rows(point)})
    workloads = list(dict.fromkeys(p["workload"] for p in points))
    return sorted(points, key=lambda p: (workloads.index(p["workload"]), p["rate_rps"]))


def handover_costs(app: str, url: str, args: argparse.Namespace, tokenizer, max_model_len: int) -> list[dict]:
    """One request at a time at each prompt length: what moving its KV from the prefill lane to the
    decode and verify lanes took, seen by the prefill lane (from KV ready to the owners holding it),
    by the verify lane (its worker busy taking the copy in) and by the client (TTFT)."""
    lengths = [n for n in args.handover_lens if n + 2 < max_model_len]
    requests = fixed_length_requests(tokenizer, lengths, args.handover_reps, args.seed + 31)
    start_s = time.time()
    result = asyncio.run(run_load(url, requests, ClosedLoop(1), timeout_s=args.request_timeout_s, seed=args.seed,
                                  progress=False))
    reports = timelines(app, "pdv", start_s)
    handovers = sorted((e for r in reports if r["lane"] == "prefill" for e in r["events"].get("handover", [])),
                       key=lambda e: e["start_s"])
    loads = sorted((e for r in reports if r["lane"] == "verify" for e in r["events"].get("load_kv", [])),
                   key=lambda e: e["start_s"])
    records = sorted(result.records, key=lambda r: r.index)
    if len(handovers) != len(records):
        raise RuntimeError(f"{len(handovers)} hand-overs recorded for {len(records)} requests")
    rows = []
    for k, length in enumerate(lengths):
        first, last = k * (args.handover_reps + 1) + 1, (k + 1) * (args.handover_reps + 1)  # skip the warm one
        mine = handovers[first:last]
        window = (mine[0]["start_s"], mine[-1]["end_s"] + 5.0)
        taken_in = [e for e in loads if window[0] <= e["start_s"] <= window[1]][: len(mine)]
        ttfts = [r.ttft_ms for r in records[first:last] if r.ttft_ms is not None]
        rows.append({
            "prompt_tokens": mine[0]["tokens"], "target": mine[0]["target"], "draft": mine[0]["draft"],
            "target_kv_mib": round(mine[0]["target_bytes"] / 2**20, 2),
            "draft_kv_mib": round(mine[0]["draft_bytes"] / 2**20, 2),
            "handover_ms": _median_ms(e["end_s"] - e["start_s"] for e in mine),
            "verify_load_ms": _median_ms(e["end_s"] - e["start_s"] for e in taken_in) if taken_in else None,
            "ttft_ms": round(statistics.median(ttfts), 2) if ttfts else None,
            "samples": len(mine),
        })
    return rows


def _median_ms(seconds) -> float:
    return round(statistics.median(seconds) * 1e3, 2)


# ---- reference copy ---------------------------------------------------------------------------

def p2p_reference(sizes_bytes: list[int]) -> list[dict] | None:
    """Device-to-device copies GPU 0 -> GPU 1 of the hand-over sizes (median of 5): what the KV
    hand-over could cost over NVLink/PCIe peer copies (NCCL would ride the same links)."""
    if torch.cuda.device_count() < 2 or not sizes_bytes:
        return None
    rows = []
    for size in sorted(set(sizes_bytes)):
        src = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(size, dtype=torch.uint8, device="cuda:1")
        times = []
        for _ in range(6):
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            start = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(1)
            times.append(time.perf_counter() - start)
        ms = statistics.median(times[1:]) * 1e3
        rows.append({"mib": round(size / 2**20, 2), "copy_ms": round(ms, 3), "gb_per_s": round(size / ms / 1e6, 1)})
        del src, dst
    torch.cuda.empty_cache()
    return rows


# ---- results ----------------------------------------------------------------------------------

def points_of(document: dict) -> list[Point]:
    """The sweep points as the load tester's Points (for its table and load curves), from the JSON."""
    return [Point(label=point_label(placement, p), summary=summary_from_dict(p["summary"]),
                  result=RunResult(base_url="", model="", arrivals=OpenLoop(p["rate_rps"]), records=[],
                                   warmup_records=[]))
            for placement in document["placements"] for p in placement.get("sweep", [])]


def point_label(placement: dict, point: dict) -> str:
    """The placement's key, and the workload unless uniform (results of older runs have only that)."""
    workload = point.get("workload", "uniform")
    return placement["key"] + ("" if workload == "uniform" else f" {workload}")


def throughput_at_tpot(document: dict) -> list[dict]:
    """Per placement and p95 TPOT bound: the most output tok/s among its unsaturated points that meet it."""
    rows = []
    for placement in document["placements"]:
        uniform = [p for p in placement.get("sweep", []) if p.get("workload", "uniform") == "uniform"]
        ok = [p for p in uniform if not p["saturated"]]
        row = {"placement": placement["key"], "knee_found": any(p["saturated"] for p in uniform)}
        for bound in TPOT_BOUNDS_MS:
            meets = [p["summary"]["output_token_throughput_tps"] for p in ok
                     if (p["summary"]["latency_ms"]["tpot_ms"]["p95"] or math.inf) <= bound]
            row[f"tpot_p95<={bound:g}ms"] = round(max(meets), 1) if meets else None
        rows.append(row)
    return rows


def goodput_table(document: dict) -> list[dict]:
    """Per placement and workload: goodput at each p99 TPOT bound (results.goodput: the most completed
    requests/s among the rates with every request completed, p99 TPOT within the bound and p99 TTFT
    within TTFT_SLO_MS), the p99 decode stall at that rate, and every request the sweep submitted."""
    rows = []
    for placement in document["placements"]:
        sweep_points = placement.get("sweep", [])
        for workload in dict.fromkeys(p.get("workload", "uniform") for p in sweep_points):
            points = [p for p in sweep_points if p.get("workload", "uniform") == workload]
            row = {"placement": placement["key"], "workload": workload,
                   **{k: sum(p["summary"][k] for p in points) for k in ("submitted", "completed", "failed",
                                                                        "timed_out")}}
            for bound in TPOT_SLOS_MS:
                best = goodput(points, bound) or {"summary": {"request_throughput_rps": None}, "row": {}}
                rps = best["summary"]["request_throughput_rps"]
                row[f"goodput rps, TPOT<={bound:g}"] = None if rps is None else round(rps, 2)
                row[f"stall ms p99, TPOT<={bound:g}"] = best.get("row", {}).get("stall_ms p99")  # none in older runs
            rows.append(row)
    return rows


def write_results(out: Path, document: dict, plots: bool = True) -> None:
    document["throughput_at_tpot"] = throughput_at_tpot(document)
    document["goodput"] = goodput_table(document)
    write_document(out, NAME, document, markdown(document))
    points = points_of(document)
    if points:
        comparison_table(points).to_csv(out / f"{NAME}.csv")
    if plots and not write_plots(out, document, points):  # the GPU image may lack matplotlib
        print(f"plots skipped (no matplotlib); run --plot-only {out} where it is installed", flush=True)


def write_plots(out: Path, document: dict, points: list[Point]) -> bool:
    """The plots, or False where matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    if points:
        plot_load_curves(points, out / f"{NAME}_load_curve.png")
    goodputs = [c for c in (document["goodput"][0] if document["goodput"] else {}) if c.startswith("goodput")]
    plot_bars(document["goodput"], out / f"{NAME}_goodput.png", tuple(goodputs), x="placement", series="workload")
    figure, axis = plt.subplots(figsize=(7, 5))
    for placement in document["placements"]:
        for workload in dict.fromkeys(p.get("workload", "uniform") for p in placement.get("sweep", [])):
            sweep_points = [p for p in placement["sweep"] if p.get("workload", "uniform") == workload]
            axis.plot([p["summary"]["latency_ms"]["tpot_ms"]["p95"] or np.nan for p in sweep_points],
                      [p["summary"]["output_token_throughput_tps"] for p in sweep_points], marker="o",
                      label=placement["title"] + ("" if workload == "uniform" else f", {workload}"))
    axis.set_xlabel("p95 TPOT (ms)")
    axis.set_ylabel("output tokens/s")
    axis.set_title("throughput at a latency: up and to the left is better")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out / f"{NAME}_tpot_throughput.png", dpi=110)
    plt.close(figure)
    with_handover = [p for p in document["placements"] if p.get("handover")]
    if not with_handover:
        return True
    figure, axis = plt.subplots(figsize=(7, 5))
    for placement in with_handover:
        rows = placement["handover"]
        axis.plot([r["prompt_tokens"] for r in rows], [r["handover_ms"] for r in rows], marker="o",
                  label=f"{placement['title']}: target KV {rows[0]['target']}")
    reference = document.get("p2p_reference") or []
    per_token = with_handover[0]["handover"][0]["target_kv_mib"] / with_handover[0]["handover"][0]["prompt_tokens"]
    if reference:
        axis.plot([r["mib"] / per_token for r in reference], [r["copy_ms"] for r in reference], linestyle="--",
                  color="grey", label="GPU0 -> GPU1 device copy of the same bytes")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    lengths = sorted({r["prompt_tokens"] for p in with_handover for r in p["handover"]})
    axis.set_xticks(lengths, [str(n) for n in lengths])
    axis.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("KV hand-over per request (ms)")
    axis.grid(True, alpha=0.3, which="both")
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out / f"{NAME}_handover.png", dpi=110)
    plt.close(figure)
    return True


def markdown(document: dict) -> str:
    m, w, pair = document["machine"], document["workload"], document["pair"]
    gpus = ", ".join(f"{g['index']}: {g['name']}" for g in document["gpus"]) or "none"
    lines = [
        f"# Lanes over two GPUs: {NAME}", "",
        f"- Machine: {m['cpu_cores']} CPU cores, GPUs {gpus}; torch {m['torch']}, Ray {m['ray']}; "
        f"commit {document['commit']}; {document['duration_s']:.0f} s in all (budget {document['budget_s']:.0f} s).",
        f"- Pair: constructed (docs/constructed_pair.md), {pair['shape']}: target {pair['target_parameters']:,} "
        f"and draft {pair['draft_parameters']:,} parameters, {pair['dtype']}, greedy next tokens agreeing on a share "
        f"{pair['agreement']:g} of the vocabulary by design (benchmarks/lib/pairs.py).",
        f"- Workload: Poisson arrivals, {w['window_s']:g} s of requests per rate (at least 8); random-token "
        f"prompts of {w['min_prompt_len']}-{w['max_prompt_len']} tokens (log-normal, median {w['prompt_len_median']:g})"
        f", outputs {w['min_output_len']}-{w['max_output_len']} (median {w['output_len_median']:g}), greedy, "
        f"ignore_eos. A rate is saturated when a request fails or p95 TTFT passes {w['sat_ttft_ms']:g} ms; the "
        "sweep stops at the first, after one rate between it and the last unsaturated one.",
        *([f"- Mixed traffic (workload `mixed`): {w['mixed']['long_share']:.0%} of prompts {w['mixed']['long']} "
           f"tokens, the rest {w['mixed']['prompt']}; {w['mixed']['output']} out; Poisson arrivals, swept as above."]
          if "mixed" in w.get("workloads", []) else []),
        f"- Command: `{document['command']}`; /dev/shm (Ray's object store) {document.get('dev_shm_gib')} GiB.", "",
    ]
    if document.get("topology"):
        lines += ["GPU links (`nvidia-smi topo -m`):", "", "```", document["topology"], "```", ""]
    lines += ["## Where each replica ran", "", "| placement | status | GPUs (lanes sharing each) | as intended | "
              "deploy s | warm-up s | sweep s |", "|---|---|---|---|---|---|---|"]
    for p in document["placements"]:
        t = p.get("timings_s", {})
        groups = " / ".join("+".join(g) for g in (p.get("placement") or {}).get("gpu_groups", [])) or "n/a"
        lines.append(f"| {p['title']} | {p['status']} | {groups} | {p.get('as_intended')} | {t.get('deploy')} | "
                     f"{t.get('warmup')} | {t.get('sweep')} |")
    for p in document["placements"]:
        if p.get("error"):
            lines += ["", f"{p['key']} failed: `{p['error']}`"]
        if p.get("handover_error"):
            lines += ["", f"{p['key']} hand-over measurement failed: `{p['handover_error']}`"]
        if p.get("reason"):
            lines += ["", f"{p['key']} skipped: {p['reason']}"]
    lines += ["", "## Rate sweep", "", "| placement | rate/s | done/failed/timed out/sent | out tok/s | "
              "TTFT p50 / p95 / p99 ms | TPOT p50 / p95 / p99 ms | stall p99 ms | acceptance | in flight | "
              "busy: verify or engines | drafting | verify while drafting |", "|---" * 12 + "|"]
    for p in document["placements"]:
        for pt in p.get("sweep", []):
            s, lanes, acc = pt["summary"], pt.get("lanes", {}), pt["summary"]["spec_decode"]
            # No completed request (a placement that failed) leaves the counters empty.
            accepted = (f"{acc['acceptance_rate']:.3f} / {acc['mean_acceptance_length']:.2f}"
                        if acc and acc.get("acceptance_rate") is not None else "n/a")
            engines = " / ".join(map(str, lanes.get("engine_busy_share", [])))
            busy = lanes.get("verify_busy_share", engines or "n/a")
            lines.append(
                f"| {point_label(p, pt)} | {pt['rate_rps']:g}{' (sat.)' if pt['saturated'] else ''} | "
                f"{s['completed']}/{s['failed']}/{s['timed_out']}/{s['submitted']} | "
                f"{s['output_token_throughput_tps']:.0f} | {_triple(s, 'ttft_ms')} | {_triple(s, 'tpot_ms')} | "
                f"{pt.get('row', {}).get('stall_ms p99', 'n/a')} | {accepted} | {s['mean_in_flight']:.1f} | "
                f"{busy} | {lanes.get('drafting_busy_share', 'n/a')} | "
                f"{lanes.get('verify_with_drafting_share', 'n/a')} |")
    lines += ["", "stall: p99 over the short requests of each one's longest gap between two stream chunks. "
              "acceptance: vLLM's acceptance rate / mean acceptance length, summed over the responses' own "
              "counters. busy: share of the window the verify lane ran forwards (pdv), or each co-located engine ran "
              "steps (unified); drafting: share during which some decode replica drafted; verify while drafting: "
              "share of the verify lane's busy time during which a decode replica was drafting (0 = the lanes took "
              "turns).", ""]
    lines += prefill_path_table([(point_label(p, pt), f"{pt['rate_rps']:g}/s", pt["lanes"]["prefill_path"])
                                 for p in document["placements"] for pt in p.get("sweep", [])
                                 if (pt.get("lanes") or {}).get("prefill_path")])
    lines += ["## Goodput and the decode stall", "",
              "Goodput at a bound: the most completed requests/s among a placement's rates at which every "
              f"submitted request completed, p99 TPOT was within the bound and p99 TTFT within {TTFT_SLO_MS:g} ms "
              "(measured rates only: known to within the rate grid). Stall: the rate sweep's stall at that rate. "
              "submitted = completed + failed + timed out, over the whole sweep.", "",
              rows_table(document.get("goodput", []))]
    lines += ["## Output throughput at a p95 TPOT bound (uniform workload)", "",
              "The most output tok/s among a placement's unsaturated rates whose p95 TPOT is within the bound.", ""]
    rows = document.get("throughput_at_tpot", [])
    header = [h for h in rows[0] if h != "knee_found"] if rows else []
    if rows:
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join("n/a" if r[h] is None else ("" if r["knee_found"] or h == "placement" else "≥")
                                    + str(r[h]) for h in header) + " |" for r in rows]
        lines += ["", "Measured rates only: a value is the throughput of the fastest unsaturated rate, so it is "
                  "known to within the rate grid (steps of 2x, one rate between at the knee); ≥ marks a placement "
                  "whose sweep ended (time or rates) before any rate saturated."]
    reference = next((r for r in rows if r["placement"] == REFERENCE), None)
    if reference:
        lines += ["", f"The same, as a multiple of ({REFERENCE}) one GPU at the same bound (the goal: a lane-isolated "
                  "placement, b or c, at 1.5 or more):", "",
                  "| placement | " + " | ".join(header[1:]) + " |", "|" + "---|" * len(header)]
        for r in rows:
            ratios = [f"{r[h] / reference[h]:.2f}" if r[h] and reference[h] else "n/a" for h in header[1:]]
            lines.append(f"| {r['placement']} | " + " | ".join(ratios) + " |")
    lines += ["", "## KV hand-over per request against prompt length", "",
              "One request at a time; median of the repeats after one warm request per length. hand-over: the "
              "prefill lane, from the prompt's KV ready to its owners holding it (allocation, copy and RPCs); verify "
              "load: the verify lane's worker busy taking a copied KV in.", "",
              "| placement | prompt tokens | target KV | draft KV | target MiB | hand-over ms | verify load ms | "
              "TTFT ms |", "|---|---|---|---|---|---|---|---|"]
    for p in document["placements"]:
        for r in p.get("handover") or []:
            lines.append(f"| {p['key']} | {r['prompt_tokens']} | {r['target']} | {r['draft']} | {r['target_kv_mib']} "
                         f"| {r['handover_ms']} | {r['verify_load_ms']} | {r['ttft_ms']} |")
    if document.get("p2p_reference"):
        lines += ["", "Reference, GPU 0 -> GPU 1 device copy of the same sizes (median of 5):", "",
                  "| MiB | copy ms | GB/s |", "|---|---|---|"]
        lines += [f"| {r['mib']} | {r['copy_ms']} | {r['gb_per_s']} |" for r in document["p2p_reference"]]
    points = points_of(document)
    if points:
        lines += ["", "## Every metric, one column per placement and rate", "",
                  markdown_table(comparison_table(points))]
    return "\n".join(lines) + "\n"


def _triple(summary: dict, metric: str) -> str:
    stats = summary["latency_ms"][metric]
    return " / ".join("n/a" if stats[k] is None else f"{stats[k]:.1f}" for k in ("p50", "p95", "p99"))


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="results directory")
    parser.add_argument("--plot-only", type=Path, default=None, help="re-draw plots and tables from DIR/dual_gpu.json")
    parser.add_argument("--placements", default="a,b,d,c,a2", help="in run order (the budget may skip the last); "
                        f"of {','.join(PLACEMENTS)}")
    parser.add_argument("--workloads", default="uniform", help="swept on every placement, in this order, each an "
                        "equal share of the placement's time: uniform (log-normal lengths), mixed (MIXED: 10 %% of "
                        "prompts 3,000 tokens, the rest 128, 128 out)")
    parser.add_argument("--shape", choices=("tinyllama-7b", "small"), default="tinyllama-7b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--agreement", type=float, default=0.8, help="the constructed pair's designed agreement")
    parser.add_argument("--pair-dir", type=Path, default=PAIR_DIR,
                        help="where the pair is saved (lib/pairs.save_pair; a finished save there is reused)")
    parser.add_argument("--rates", default=None, help="requests/s, swept in order until one saturates "
                        "(default 4,8,16,32,64,128 on cuda, 1,2 on cpu)")
    parser.add_argument("--no-refine", dest="refine", action="store_false",
                        help="no extra rate between the last unsaturated and the saturated one")
    parser.add_argument("--window-s", type=float, default=None, help="seconds of arrivals per rate (5 cuda, 4 cpu)")
    parser.add_argument("--sat-ttft-ms", type=float, default=3000.0, help="p95 TTFT that marks a rate saturated")
    parser.add_argument("--handover-lens", default=None, help="prompt tokens of the hand-over test "
                        "(128,512,1024,2048 on cuda; 32,128,512 on cpu)")
    parser.add_argument("--handover-reps", type=int, default=3)
    parser.add_argument("--no-handover", dest="handover", action="store_false",
                        help="no hand-over measurement in pdv placements (its time goes to the sweeps)")
    parser.add_argument("--budget-s", type=float, default=500.0, help="wall-clock allowance of the whole run")
    parser.add_argument("--seed", type=int, default=0)
    lengths = ("prompt_len_median", "min_prompt_len", "max_prompt_len", "output_len_median", "min_output_len",
               "max_output_len", "request_timeout_s", "deploy_timeout_s")
    for key in lengths:  # the single-GPU benchmarks' workload (PRESETS), unless overridden
        parser.add_argument("--" + key.replace("_", "-"), type=type(PRESETS["cuda"][key]), default=None,
                            help=f"default {PRESETS['cuda'][key]} on cuda, {PRESETS['cpu'][key]} on cpu")
    args = parser.parse_args(argv)
    if args.plot_only is None and args.out is None:
        parser.error("--out is required (or --plot-only DIR)")
    for key in lengths:
        if getattr(args, key) is None:
            setattr(args, key, PRESETS[args.device][key])
    on_gpu = args.device == "cuda"
    args.rates = [float(r) for r in (args.rates or ("4,8,16,32,64,128" if on_gpu else "1,2")).split(",")]
    args.window_s = args.window_s or (5.0 if on_gpu else 4.0)
    args.handover_lens = [int(n) for n in (args.handover_lens or ("128,512,1024,2048" if on_gpu else
                                                                  "32,128,512")).split(",")]
    args.dtype = PRESETS[args.device]["dtype"]
    args.placements = args.placements.split(",")
    unknown = [k for k in args.placements if k not in PLACEMENTS]
    if unknown:
        parser.error(f"unknown placements {unknown}; choose from {sorted(PLACEMENTS)}")
    args.workloads = args.workloads.split(",")
    if set(args.workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads in {args.workloads}; choose from {WORKLOADS}")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.plot_only is not None:
        document = json.loads((args.plot_only / f"{NAME}.json").read_text())
        write_results(args.plot_only, document)
        log(f"wrote plots and tables in {args.plot_only}")
        return
    deadline_s = time.monotonic() + args.budget_s
    log(f"dual_gpu: placements {args.placements} on {args.device}, budget {args.budget_s:.0f} s")
    pair = save_pair(args.shape, args.agreement, args.pair_dir, dtype=args.dtype, device=args.device, seed=args.seed)
    configs = {key: placement_args(PLACEMENTS[key], str(pair.target), str(pair.draft), args.device)
               for key in args.placements}
    fit_lengths(args, configs)
    tokenizer = load_tokenizer(pair.target)
    inventory = gpu_inventory()
    target_config, draft_config = shape_configs(args.shape)
    document = {
        "command": "python3 benchmarks/dual_gpu.py " + " ".join(argv), "machine": machine(), "gpus": inventory,
        "topology": topology(), "dev_shm_gib": shm_gib(), "commit": git_commit(), "budget_s": args.budget_s,
        "pair": {"shape": args.shape, "agreement": args.agreement, "dtype": args.dtype, "target": str(pair.target),
                 "draft": str(pair.draft), "save_s": round(pair.save_s, 1), "check": pair.check,
                 "target_parameters": parameter_count(target_config),
                 "draft_parameters": parameter_count(draft_config)},
        "workload": {k: getattr(args, k) for k in (
            "rates", "window_s", "sat_ttft_ms", "prompt_len_median", "min_prompt_len", "max_prompt_len",
            "output_len_median", "min_output_len", "max_output_len", "handover_lens", "handover_reps", "seed",
            "workloads")} | {"mixed": MIXED[args.device]},
        "placements": [], "duration_s": 0.0}
    port = start_model_cluster({"TOKENIZERS_PARALLELISM": "false"})
    free_bytes = [torch.cuda.mem_get_info(g["index"])[0] for g in inventory]
    log(f"Ray and Serve up (port {port}); GPUs {[g['name'] for g in inventory] or 'none'}")
    try:
        for n, key in enumerate(args.placements):
            spec, placements_left = PLACEMENTS[key], len(args.placements) - n
            left_s = deadline_s - time.monotonic() - RESERVE_S
            if left_s / placements_left < MIN_PLACEMENT_S[args.device]:
                reason = f"{left_s:.0f} s of the budget left for {placements_left} placements"
                document["placements"].append({"key": key, "title": spec.title, "status": "skipped", "reason": reason})
                log(f"{key}: skipped ({reason})")
                continue
            log(f"{key}: {spec.title}: {left_s / placements_left:.0f} s for it")
            document["placements"].append({"key": key, "title": spec.title, "status": "running"})

            def on_point(result: dict) -> None:  # a run cut short keeps every point measured
                document["placements"][-1] = result
                write_results(args.out, document, plots=False)

            document["placements"][-1] = run_placement(spec, configs[key], args, tokenizer, port,
                                                       time.monotonic() + left_s / placements_left, inventory,
                                                       on_point)
            for gpu, free in zip(inventory, free_bytes):  # the deleted replicas' memory is back
                with torch.cuda.device(gpu["index"]):
                    wait_for_device_memory(free, timeout_s=30)
            document["duration_s"] = round(args.budget_s - (deadline_s - time.monotonic()), 1)
            write_results(args.out, document, plots=False)
    finally:
        serve.shutdown()
        ray.shutdown()
    if deadline_s - time.monotonic() > 10:
        sizes = [round(r["target_kv_mib"] * 2**20) for p in document["placements"] for r in p.get("handover") or []]
        document["p2p_reference"] = p2p_reference(sizes)
    document["duration_s"] = round(args.budget_s - (deadline_s - time.monotonic()), 1)
    write_results(args.out, document)
    log(f"done: {args.out / (NAME + '.md')}")
    print((args.out / f"{NAME}.md").read_text(), flush=True)


def fit_lengths(args: argparse.Namespace, configs: dict[str, dict]) -> None:
    """Mixed traffic's long prompts need a longer context than the placement files give: raise it. Uniform
    prompts long enough to be refused would fail at every rate: cap them to the smallest context."""
    if "mixed" in args.workloads:
        needed = MIXED[args.device]["long"] + MIXED[args.device]["output"] + 64
        for key, config in configs.items():
            if config["engine"]["max_model_len"] < needed:
                log(f"{key}: max_model_len {config['engine']['max_model_len']} -> {needed} (mixed traffic)")
                config["engine"]["max_model_len"] = needed
                AppConfig.model_validate(config)
    context = min(AppConfig.model_validate(c).engine.max_model_len for c in configs.values())
    longest = context - args.max_output_len - 8
    if args.max_prompt_len > longest:
        log(f"max prompt {args.max_prompt_len} -> {longest} tokens (context {context}, outputs up to "
            f"{args.max_output_len})")
        args.max_prompt_len = longest


if __name__ == "__main__":
    main()

"""Lanes placed over the two GPUs of one host, against one GPU and against data parallelism
(issue 8; method and results in docs/dual_gpu.md).

Placements, each one file of configs/placements/ deployed as it is (only the model paths are
replaced by the pair this run saves):

    a   unified-1gpu        the co-located engine on one GPU (the one-GPU reference)
    a2  pdv-1gpu            the three lanes on one GPU (KV by CUDA IPC)
    b   pdv-verify-apart    prefill + 2 decode replicas on one GPU, verify alone on the other
    c   pdv-prefill-apart   prefill alone on one GPU, 2 decode replicas + verify on the other
    d   unified-dp2         two co-located engines, one per GPU (data parallel)

Per placement, in one Ray cluster, one placement at a time: deploy and record which GPU every
replica got (checked against what the config means); warm up (a burst that passes every CUDA-graph
batch bucket); a Poisson rate sweep with the load tester (rates doubling until p95 TTFT shows
queueing or a request fails, then one rate between the last two), every request accounted for,
acceptance measured from each response's spec-decode counters; from the lanes' timelines
(deployments/timeline.py), how long the verify lane ran while a decode replica was drafting;
in pdv placements the cost of each KV hand-over against prompt length (one request at a time).
Ends with a device-to-device copy between the two GPUs of the same sizes, as a reference for
what the hand-over could cost over NVLink.

The whole run keeps to --budget-s: a placement that no longer fits is recorded as skipped, a
placement that fails is recorded with its error, and results are rewritten after each placement.

    python3 benchmarks/dual_gpu.py --out DIR                       # two-H200 machine, under 9 minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dual_gpu.py --shape small --device cpu \\
        --budget-s 1300 --out DIR                                  # CPU dry run: every step, no GPUs
    .venv/bin/python benchmarks/dual_gpu.py --plot-only DIR        # plots from DIR/dual_gpu.json

Writes DIR/dual_gpu.json (everything, every request), dual_gpu.md (tables), dual_gpu.csv (one
column per placement and rate) and, where matplotlib is installed, dual_gpu_load_curve.png,
dual_gpu_tpot_throughput.png and dual_gpu_handover.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # replicas inherit it: kernels compile for the GPU

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from ray import serve  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.constructed_pair import shape_configs  # noqa: E402
from benchmarks.lib.apps import PRESETS  # noqa: E402
from benchmarks.lib.cluster import (REPO, deploy, git_commit, log, machine, replica_log_tail,  # noqa: E402
                                    start_cluster, wait_for_device_memory)
from benchmarks.lib.pairs import parameter_count, save_pair  # noqa: E402
from benchmarks.lane_timelines import lane_activity, prefill_path_table, timelines  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from loadtest.arrivals import ClosedLoop, OpenLoop  # noqa: E402
from loadtest.records import RequestRecord  # noqa: E402
from loadtest.report import Point, comparison_table, markdown_table, plot_load_curves  # noqa: E402
from loadtest.runner import RunResult, run_load  # noqa: E402
from loadtest.spec_stats import SpecDecodeCounters, SpecDecodeSummary  # noqa: E402
from loadtest.summary import LatencyStats, Summary  # noqa: E402
from loadtest.workload import (LogNormal, WorkloadRequest, count_tokens, load_tokenizer,  # noqa: E402
                               random_prompt, synthetic, usable_token_ids)

NAME = "dual_gpu"
TPOT_BOUNDS_MS = (5, 7.5, 10, 15, 20, 30, 50, 100)  # p95 TPOT bounds of the throughput-at-latency table
REFERENCE = "a"  # the one-GPU placement the goal compares against
RESERVE_S = 20.0  # kept back from the budget for the last results and the reference copy
MIN_PLACEMENT_S = {"cuda": 75.0, "cpu": 60.0}  # less, and a placement cannot deploy, warm up and run two rates
DELETE_S = 10.0  # what removing an app takes, allowed for in every placement
HANDOVER_S = {"cuda": 20.0, "cpu": 30.0}  # the hand-over measurement, allowed for in pdv placements


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
)}


# ---- where replicas run ------------------------------------------------------------------------

def gpu_inventory() -> list[dict]:
    """The driver's view of this host's GPUs: index, name and UUID (replicas report UUIDs)."""
    if not torch.cuda.is_available():
        return []
    return [{"index": i, "name": torch.cuda.get_device_name(i), "uuid": str(torch.cuda.get_device_properties(i).uuid)}
            for i in range(torch.cuda.device_count())]


def topology() -> str | None:
    """`nvidia-smi topo -m`: how the GPUs are linked (NVLink or PCIe) decides what a KV copy costs."""
    try:
        done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def shm_gib() -> float | None:
    """Size of /dev/shm, where Ray's object store lives (copied KV passes through it)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return round(stat.f_blocks * stat.f_frsize / 2**30, 1)


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

def sweep_requests(args: argparse.Namespace, tokenizer, rate: float) -> list[WorkloadRequest]:
    """About `window_s` seconds of requests at `rate`, the same for every placement (seeded by the
    rate); lengths drawn as gpu_modes.workloads draws them."""
    return synthetic(tokenizer, max(8, round(rate * args.window_s)), args.seed + round(rate * 100),
                     LogNormal(args.prompt_len_median, 0.6, args.min_prompt_len, args.max_prompt_len),
                     LogNormal(args.output_len_median, 0.3, args.min_output_len, args.max_output_len))


def warmup_requests(args: argparse.Namespace, tokenizer, count: int) -> list[WorkloadRequest]:
    # Outputs of 4-64 tokens end at different times, so the batch passes every bucket going down.
    return synthetic(tokenizer, count, args.seed + 7,
                     LogNormal(args.prompt_len_median, 0.6, args.min_prompt_len, args.max_prompt_len),
                     LogNormal(24, 0.6, 4, 64))


def fixed_length_requests(tokenizer, lengths: list[int], reps: int, seed: int) -> list[WorkloadRequest]:
    """For each length, reps + 1 prompts of exactly that many tokens (the first warms that shape)."""
    rng, usable = np.random.default_rng(seed), usable_token_ids(tokenizer)
    out = []
    for length in lengths:
        for _ in range(reps + 1):
            prompt = random_prompt(tokenizer, usable, length, rng)
            out.append(WorkloadRequest(prompt, count_tokens(tokenizer, prompt), 2))
    return out


def request_spec_counters(records: list[RequestRecord]) -> SpecDecodeCounters:
    """vLLM's spec-decode counters summed over the completed requests' own usage.spec_decode. The
    server's totals would be partial: each ingress replica counts only the requests it served."""
    done = [r for r in records if r.status == "completed" and r.num_draft_tokens]
    return SpecDecodeCounters(sum(r.num_drafts for r in done), sum(r.num_draft_tokens for r in done),
                              sum(r.num_accepted_tokens for r in done), [])


def summary_of(document_summary: dict) -> Summary:
    """A Summary back from its JSON (to_dict) form."""
    def stats(by_metric: dict) -> dict[str, LatencyStats]:
        return {metric: LatencyStats(**values) for metric, values in by_metric.items()}

    spec = document_summary["spec_decode"]
    return Summary(**{**document_summary, "latency_ms": stats(document_summary["latency_ms"]),
                      "latency_ms_by_kind": {kind: stats(v) for kind, v in document_summary["latency_ms_by_kind"].items()},
                      "spec_decode": SpecDecodeSummary(**spec) if spec else None})


# ---- one placement ----------------------------------------------------------------------------

def run_placement(spec: PlacementSpec, app_args: dict, args: argparse.Namespace, tokenizer, port: int,
                  deadline_s: float, inventory: list[dict]) -> dict:
    """Deploy, check where replicas run, warm up, sweep, measure hand-overs; the app is removed after."""
    mode = app_args["mode"]
    result: dict = {"key": spec.key, "title": spec.title, "config": f"configs/placements/{spec.config}",
                    "app_args": app_args, "status": "running", "timings_s": {}, "sweep": []}
    url = f"http://127.0.0.1:{port}/{spec.key}"
    try:
        phase_s = time.monotonic()
        deploy(spec.key, app_args, timeout_s=max(30.0, deadline_s - time.monotonic() - DELETE_S))
        result["timings_s"]["deploy"] = round(time.monotonic() - phase_s, 1)
        log(f"{spec.key}: deployed in {result['timings_s']['deploy']} s")
        observed = observed_gpus(timelines(spec.key, mode, time.time()), inventory)
        result |= {"placement": observed, "as_intended": as_intended(spec, observed),
                   "asked_num_gpus": replica_gpus(app_args)}
        log(f"{spec.key}: GPUs {observed['gpu_groups'] or 'none (CPU)'}, as intended: {result['as_intended']}")

        phase_s = time.monotonic()
        warm = warmup_requests(args, tokenizer, decode_slots(app_args))
        timeout_s = max(15.0, min(args.request_timeout_s, deadline_s - time.monotonic() - DELETE_S))
        warmed = asyncio.run(run_load(url, warm, OpenLoop(math.inf), timeout_s=timeout_s, seed=args.seed,
                                      progress=False))
        result["warmup"] = {"requests": len(warm), "completed": sum(r.status == "completed" for r in warmed.records)}
        result["timings_s"]["warmup"] = round(time.monotonic() - phase_s, 1)
        log(f"{spec.key}: warm-up {result['warmup']['completed']}/{len(warm)} in {result['timings_s']['warmup']} s")

        phase_s, sweep_start_s = time.monotonic(), time.time()
        reserve_s = DELETE_S + (HANDOVER_S[args.device] if mode == "pdv" else 0.0)
        result["sweep"] = sweep(spec, url, args, tokenizer, deadline_s - reserve_s)
        reports = timelines(spec.key, mode, sweep_start_s)
        for point in result["sweep"]:
            point["lanes"] = lane_activity(reports, point["window_unix_s"][0], point["window_unix_s"][1])
        result["timings_s"]["sweep"] = round(time.monotonic() - phase_s, 1)

        if mode == "pdv":
            phase_s = time.monotonic()
            max_model_len = AppConfig.model_validate(app_args).engine.max_model_len
            try:
                result["handover"] = handover_costs(spec.key, url, args, tokenizer, max_model_len)
            except Exception as exc:  # noqa: BLE001 - the sweep's results stand without it
                result["handover_error"] = f"{type(exc).__name__}: {exc}"
            result["timings_s"]["handover"] = round(time.monotonic() - phase_s, 1)
            log(f"{spec.key}: hand-over in {result['timings_s']['handover']} s "
                f"{result.get('handover_error') or json.dumps(result['handover'])}")
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - recorded; the next placement still runs
        result |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                   "replica_logs": replica_log_tail(spec.key)[-6000:]}
        log(f"{spec.key}: FAILED {result['error']}\n{result['replica_logs']}")
    finally:
        phase_s = time.monotonic()
        try:
            serve.delete(spec.key)
        except Exception as exc:  # noqa: BLE001
            log(f"{spec.key}: delete failed: {exc}")
        result["timings_s"]["delete"] = round(time.monotonic() - phase_s, 1)
    return result


def sweep(spec: PlacementSpec, url: str, args: argparse.Namespace, tokenizer, deadline_s: float) -> list[dict]:
    """Poisson arrivals at each rate until one saturates or time runs out; after the first saturated
    rate, one rate between it and the last unsaturated one (the knee is where placements differ)."""
    points: list[dict] = []
    rates, last_ok = list(args.rates), None
    while rates:
        rate = rates.pop(0)
        requests = sweep_requests(args, tokenizer, rate)
        # Arrivals, then the slowest requests still running: the previous rate's p95 E2E says how long.
        tail_s = (points[-1]["summary"]["latency_ms"]["e2e_ms"]["p95"] or 5e3) / 1e3 if points else 5.0
        if time.monotonic() + len(requests) / rate + tail_s > deadline_s:
            log(f"{spec.key}: rate {rate:g} skipped, {deadline_s - time.monotonic():.0f} s left for it")
            break
        # A request never waits past the placement's time (a stuck lane must not eat the next one's).
        timeout_s = max(15.0, min(args.request_timeout_s, deadline_s - time.monotonic()))
        point = sweep_point(url, requests, rate, args.seed, args.sat_ttft_ms, timeout_s)
        points.append(point)
        log(f"{spec.key}: {point_line(point)}")
        if not point["saturated"]:
            last_ok = rate
            continue
        between = round(math.sqrt(last_ok * rate), 2) if last_ok is not None else None
        rates = [between] if args.refine and between is not None and between not in args.rates + [rate] else []
        last_ok = None  # after the rate between, stop whatever it shows
    return sorted(points, key=lambda p: p["rate_rps"])


def point_line(point: dict) -> str:
    s, acc = point["summary"], point["summary"]["spec_decode"]
    return (f"rate {point['rate_rps']:g}/s: {s['completed']}/{s['submitted']} completed, "
            f"{s['output_token_throughput_tps']:.0f} tok/s, TTFT p95 {_ms(s, 'ttft_ms', 'p95')}, "
            f"TPOT p95 {_ms(s, 'tpot_ms', 'p95')}, acceptance {acc['acceptance_rate'] if acc else None}"
            + (" SATURATED" if point["saturated"] else ""))


def sweep_point(url: str, requests: list[WorkloadRequest], rate: float, seed: int, sat_ttft_ms: float,
                timeout_s: float) -> dict:
    start_s = time.time()
    result = asyncio.run(run_load(url, requests, OpenLoop(rate), timeout_s=timeout_s, seed=seed, progress=False))
    end_s = time.time()
    result.spec_before, result.spec_after = SpecDecodeCounters(0, 0, 0, []), request_spec_counters(result.records)
    result.spec_error = None
    summary = result.summary().to_dict()
    ttft_p95 = summary["latency_ms"]["ttft_ms"]["p95"]
    saturated = summary["completed"] < summary["submitted"] or ttft_p95 is None or ttft_p95 > sat_ttft_ms
    return {"rate_rps": rate, "window_unix_s": [start_s, end_s], "summary": summary, "saturated": saturated,
            # Every request, without its inter-token gaps (the summary keeps their percentiles).
            "requests": [{k: v for k, v in r.to_row().items() if k != "itl_ms"} for r in result.records]}


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


def _ms(summary: dict, metric: str, stat: str) -> str:
    value = summary["latency_ms"][metric][stat]
    return "n/a" if value is None else f"{value:.1f} ms"


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
    return [Point(label=placement["key"], summary=summary_of(p["summary"]),
                  result=RunResult(base_url="", model="", arrivals=OpenLoop(p["rate_rps"]), records=[],
                                   warmup_records=[]))
            for placement in document["placements"] for p in placement.get("sweep", [])]


def throughput_at_tpot(document: dict) -> list[dict]:
    """Per placement and p95 TPOT bound: the most output tok/s among its unsaturated points that meet it."""
    rows = []
    for placement in document["placements"]:
        ok = [p for p in placement.get("sweep", []) if not p["saturated"]]
        row = {"placement": placement["key"], "knee_found": any(p["saturated"] for p in placement.get("sweep", []))}
        for bound in TPOT_BOUNDS_MS:
            meets = [p["summary"]["output_token_throughput_tps"] for p in ok
                     if (p["summary"]["latency_ms"]["tpot_ms"]["p95"] or math.inf) <= bound]
            row[f"tpot_p95<={bound:g}ms"] = round(max(meets), 1) if meets else None
        rows.append(row)
    return rows


def write_results(out: Path, document: dict, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    document["throughput_at_tpot"] = throughput_at_tpot(document)
    (out / f"{NAME}.json").write_text(json.dumps(document, indent=1))
    points = points_of(document)
    if points:
        comparison_table(points).to_csv(out / f"{NAME}.csv")
    (out / f"{NAME}.md").write_text(markdown(document))
    if plots:
        try:
            write_plots(out, document, points)
        except ImportError as exc:  # the GPU image may lack matplotlib: plot later with --plot-only
            print(f"plots skipped ({exc}); run --plot-only {out} where matplotlib is installed", flush=True)


def write_plots(out: Path, document: dict, points: list[Point]) -> None:
    from loadtest.report import _pyplot

    if points:
        plot_load_curves(points, out / f"{NAME}_load_curve.png")
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 5))
    for placement in document["placements"]:
        sweep_points = placement.get("sweep", [])
        if sweep_points:
            axis.plot([p["summary"]["latency_ms"]["tpot_ms"]["p95"] or np.nan for p in sweep_points],
                      [p["summary"]["output_token_throughput_tps"] for p in sweep_points], marker="o",
                      label=placement["title"])
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
        return
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


def markdown(document: dict) -> str:
    m, w, pair = document["machine"], document["workload"], document["pair"]
    gpus = ", ".join(f"{g['index']}: {g['name']}" for g in document["gpus"]) or "none"
    lines = [
        f"# Lanes over two GPUs: {NAME}", "",
        f"- Machine: {m['cpu_cores']} CPU cores, GPUs {gpus}; torch {m['torch']}, Ray {m['ray']}; "
        f"commit {document['commit']}; {document['duration_s']:.0f} s in all (budget {document['budget_s']:.0f} s).",
        f"- Pair: constructed (docs/constructed_pair.md), {pair['shape']}: target {pair['target_parameters']:,} "
        f"and draft {pair['draft_parameters']:,} parameters, {pair['dtype']}, greedy next tokens agreeing on a share "
        f"{pair['agreement']:g} of the vocabulary by design (the pair of benchmarks/gpu_modes.py).",
        f"- Workload: Poisson arrivals, {w['window_s']:g} s of requests per rate (at least 8); random-token "
        f"prompts of {w['min_prompt_len']}-{w['max_prompt_len']} tokens (log-normal, median {w['prompt_len_median']:g})"
        f", outputs {w['min_output_len']}-{w['max_output_len']} (median {w['output_len_median']:g}), greedy, "
        f"ignore_eos. A rate is saturated when a request fails or p95 TTFT passes {w['sat_ttft_ms']:g} ms; the "
        "sweep stops at the first, after one rate between it and the last unsaturated one.",
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
    lines += ["", "## Rate sweep", "", "| placement | rate/s | done/sent | out tok/s | TTFT p50 / p95 / p99 ms | "
              "TPOT p50 / p95 / p99 ms | acceptance | in flight | busy: verify or engines | drafting | "
              "verify while drafting |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in document["placements"]:
        for pt in p.get("sweep", []):
            s, lanes, acc = pt["summary"], pt.get("lanes", {}), pt["summary"]["spec_decode"]
            # No completed request (a placement that failed) leaves the counters empty.
            accepted = (f"{acc['acceptance_rate']:.3f} / {acc['mean_acceptance_length']:.2f}"
                        if acc and acc.get("acceptance_rate") is not None else "n/a")
            busy = lanes.get("verify_busy_share", " / ".join(map(str, lanes.get("engine_busy_share", []))) or "n/a")
            lines.append(
                f"| {p['key']} | {pt['rate_rps']:g}{' (sat.)' if pt['saturated'] else ''} | "
                f"{s['completed']}/{s['submitted']} | {s['output_token_throughput_tps']:.0f} | "
                f"{_triple(s, 'ttft_ms')} | {_triple(s, 'tpot_ms')} | {accepted} | {s['mean_in_flight']:.1f} | "
                f"{busy} | {lanes.get('drafting_busy_share', 'n/a')} | {lanes.get('verify_with_drafting_share', 'n/a')} |")
    lines += ["", "acceptance: vLLM's acceptance rate / mean acceptance length, summed over the responses' own "
              "counters. busy: share of the window the verify lane ran forwards (pdv), or each co-located engine ran "
              "steps (unified); drafting: share during which some decode replica drafted; verify while drafting: "
              "share of the verify lane's busy time during which a decode replica was drafting (0 = the lanes took "
              "turns).", ""]
    lines += prefill_path_table([(p["key"], f"{pt['rate_rps']:g}/s", pt["lanes"]["prefill_path"])
                                 for p in document["placements"] for pt in p.get("sweep", [])
                                 if (pt.get("lanes") or {}).get("prefill_path")])
    lines += ["## Output throughput at a p95 TPOT bound", "",
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
    parser.add_argument("--placements", default="a,b,d,c,a2", help="in run order (the budget may skip the last)")
    parser.add_argument("--shape", choices=("tinyllama-7b", "small"), default="tinyllama-7b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--agreement", type=float, default=0.8, help="the constructed pair's designed agreement")
    parser.add_argument("--pair-dir", type=Path, default=Path("/tmp/vpd_gpu_modes"),
                        help="where the pair is saved (gpu_modes.save_pair; a finished save there is reused)")
    parser.add_argument("--rates", default=None, help="requests/s, swept in order until one saturates "
                        "(default 4,8,16,32,64,128 on cuda, 1,2 on cpu)")
    parser.add_argument("--no-refine", dest="refine", action="store_false",
                        help="no extra rate between the last unsaturated and the saturated one")
    parser.add_argument("--window-s", type=float, default=None, help="seconds of arrivals per rate (5 cuda, 4 cpu)")
    parser.add_argument("--sat-ttft-ms", type=float, default=3000.0, help="p95 TTFT that marks a rate saturated")
    parser.add_argument("--handover-lens", default=None, help="prompt tokens of the hand-over test "
                        "(128,512,1024,2048 on cuda; 32,128,512 on cpu)")
    parser.add_argument("--handover-reps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=500.0, help="wall-clock allowance of the whole run")
    parser.add_argument("--seed", type=int, default=0)
    lengths = ("prompt_len_median", "min_prompt_len", "max_prompt_len", "output_len_median", "min_output_len",
               "max_output_len", "request_timeout_s", "deploy_timeout_s")
    for key in lengths:  # the single-GPU benchmark's workload (gpu_modes.PRESETS), unless overridden
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
    fit_prompts(args, configs)
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
            "output_len_median", "min_output_len", "max_output_len", "handover_lens", "handover_reps", "seed")},
        "placements": [], "duration_s": 0.0}
    # A replica that fails to start is not retried three times (each try would load 13.5 GB again).
    os.environ["RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"] = "1"
    port = start_cluster({"TRITON_INTERPRET": os.environ["TRITON_INTERPRET"], "TOKENIZERS_PARALLELISM": "false",
                          "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1"})
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
            document["placements"].append(run_placement(spec, configs[key], args, tokenizer, port,
                                                        time.monotonic() + left_s / placements_left, inventory))
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


def fit_prompts(args: argparse.Namespace, configs: dict[str, dict]) -> None:
    """Prompts long enough to be refused would fail at every rate: cap them to the smallest context."""
    context = min(AppConfig.model_validate(c).engine.max_model_len for c in configs.values())
    longest = context - args.max_output_len - 8
    if args.max_prompt_len > longest:
        log(f"max prompt {args.max_prompt_len} -> {longest} tokens (context {context}, outputs up to "
            f"{args.max_output_len})")
        args.max_prompt_len = longest

if __name__ == "__main__":
    main()
